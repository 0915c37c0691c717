"""A rank's placement: its place in the world, on its host (local) and among the ranks that
share its local rank (cross), computed in one place with Horovod's numbering rules.

Every launcher (aiakrun's MPI and Gloo modes, the elastic driver, Ray, Spark) decides only
which host each rank runs on and hands that list to :func:`place_ranks`; the Gloo transport's
world description extends :class:`RankIdentity`.  So every part of the project speaks of a
rank's place with the same seven fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence


@dataclass(frozen=True)
class RankIdentity:
    """One rank's placement (Horovod's ``rank_and_size`` record plus its host)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str

    def horovod_env(self) -> Dict[str, str]:
        """The placement as Horovod's variables, which a rank's ``hvd.init()`` reads in the
        Gloo mode (and which user code may read in either mode)."""
        return {"HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
                "HOROVOD_LOCAL_RANK": str(self.local_rank),
                "HOROVOD_LOCAL_SIZE": str(self.local_size),
                "HOROVOD_CROSS_RANK": str(self.cross_rank),
                "HOROVOD_CROSS_SIZE": str(self.cross_size),
                "HOROVOD_HOSTNAME": self.hostname}


def place_ranks(hosts_by_rank: Sequence[str]) -> List[RankIdentity]:
    """The placement of every rank, given the host of each rank in rank order.

    Horovod's rules: hosts are ordered by their first appearance; a rank's local rank is its
    position among the ranks of its host; its cross rank is the index of its host among the
    hosts that have a rank with that local rank, and its cross size is how many such hosts
    there are.  A host's ranks need not be adjacent (callers that need them adjacent, such
    as hydra's proxies, reorder first).  Raises ValueError for an empty list or an empty
    host name, since either would give ranks that cannot find their node.
    """
    if isinstance(hosts_by_rank, str):
        raise ValueError(f"place_ranks takes one host name per rank, not the string "
                         f"{hosts_by_rank!r}")
    if not hosts_by_rank:
        raise ValueError("place_ranks: no ranks to place (the host list is empty)")
    local_size: Dict[str, int] = {}  # ranks per host, keyed in first-appearance order
    local_ranks: List[int] = []
    for rank, host in enumerate(hosts_by_rank):
        if not isinstance(host, str) or not host:
            raise ValueError(f"place_ranks: rank {rank} has no host name ({host!r})")
        local_ranks.append(local_size.get(host, 0))
        local_size[host] = local_ranks[-1] + 1
    # For each local rank, the hosts that have a rank with it, in host order.
    sharing: List[List[str]] = [[h for h, n in local_size.items() if n > lr]
                                for lr in range(max(local_size.values()))]
    size = len(hosts_by_rank)
    return [RankIdentity(rank=rank, size=size, local_rank=lr, local_size=local_size[host],
                         cross_rank=sharing[lr].index(host), cross_size=len(sharing[lr]),
                         hostname=host)
            for rank, (host, lr) in enumerate(zip(hosts_by_rank, local_ranks))]
