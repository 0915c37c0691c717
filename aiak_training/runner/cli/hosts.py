"""Host lists (``-H``, ``--hostfile``, ``AIAK_CLUSTER_HOSTS``) and rank-to-host assignment."""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from aiak_training.common.job.ranks import RankIdentity, place_ranks

# horovodrun's check for one ``-H`` entry (runner/launch.py); kept identical so that a host
# string horovodrun rejects is rejected here too.
HOST_ENTRY_RE = re.compile(r"^[\w.-]+:[0-9]+$")

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}


@dataclass(frozen=True)
class HostSlots:
    """One host and the number of ranks it may run."""

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def parse_hosts(spec: str) -> List[HostSlots]:
    """Parse ``"a:2,b:4"`` into host entries.

    Raises ValueError naming the offending entry, since a typo in ``-H`` would otherwise surface
    much later as an obscure MPI launcher error.
    """
    if not spec or not spec.strip():
        raise ValueError("empty host list; expected host1:slots,host2:slots,...")
    hosts: List[HostSlots] = []
    for entry in spec.split(","):
        entry = entry.strip()
        if not HOST_ENTRY_RE.match(entry):
            raise ValueError(f"invalid host entry {entry!r} in {spec!r}: expected "
                             "host:slots (for example -H server1:2,server2:4)")
        name, slots = entry.rsplit(":", 1)
        hosts.append(HostSlots(name, int(slots)))
    return _validated(hosts, spec)


def parse_hostfile(path: str) -> List[HostSlots]:
    """Parse a hostfile with lines ``host slots=N`` (``#`` comments and blank lines allowed).

    A bare ``host`` line means one slot, as in Open MPI hostfiles; ``host:N`` is MPICH's and
    Intel MPI's form (the Kubeflow MPI Operator writes it for those MPIs).
    """
    hosts: List[HostSlots] = []
    with open(path, "r", encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            name, slots = fields[0], 1
            if re.match(r"^[^:]+:[0-9]+$", name) and len(fields) == 1:  # hydra's host:N
                name, count = name.rsplit(":", 1)
                slots = int(count)
            for extra in fields[1:]:
                key, sep, value = extra.partition("=")
                if key in ("slots", "max_slots", "max-slots") and sep and value.isdigit():
                    if key == "slots":
                        slots = int(value)
                else:
                    raise ValueError(f"{path}:{lineno}: cannot parse {raw.strip()!r}; "
                                     "expected 'hostname slots=N'")
            if not re.match(r"^[\w.-]+$", name):
                raise ValueError(f"{path}:{lineno}: invalid host name {name!r}")
            hosts.append(HostSlots(name, slots))
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts")
    return _validated(hosts, path)


def _validated(hosts: List[HostSlots], source: str) -> List[HostSlots]:
    seen = set()
    for h in hosts:
        if h.slots < 1:
            raise ValueError(f"host {h.name!r} in {source!r} has {h.slots} slots; need >= 1")
        if h.name in seen:
            # Silently merging or overwriting would change the rank layout the user asked for.
            raise ValueError(f"host {h.name!r} is listed more than once in {source!r}")
        seen.add(h.name)
    return hosts


def total_slots(hosts: Sequence[HostSlots]) -> int:
    """Sum of slots over ``hosts``."""
    return sum(h.slots for h in hosts)


def assign_slots(hosts: Sequence[HostSlots], num_proc: int) -> List[RankIdentity]:
    """Place ``num_proc`` ranks, filling hosts in the order given (Horovod's rule).

    Rank r goes to the first host that still has a free slot, so ``-H a:2,b:2 -np 3`` gives
    ranks 0,1 on ``a`` and rank 2 on ``b``; this is also the order MPI launchers use for
    ``host:slots`` lists.  Raises ValueError when there are fewer slots than ranks.
    """
    if num_proc < 1:
        raise ValueError(f"-np must be >= 1, got {num_proc}")
    available = total_slots(hosts)
    if num_proc > available:
        listing = ",".join(str(h) for h in hosts)
        raise ValueError(f"-np {num_proc} needs more slots than the {available} given "
                         f"by the host list {listing}")
    slots = [h.name for h in hosts for _ in range(h.slots)]
    return place_ranks(slots[:num_proc])


def used_hosts(placement: Sequence[RankIdentity]) -> List[HostSlots]:
    """The hosts that actually receive ranks, with the number of ranks each gets, in order."""
    return [HostSlots(r.hostname, r.local_size) for r in placement if r.local_rank == 0]


def is_local_host(name: str) -> bool:
    """True for names that denote the machine aiakrun runs on."""
    if name in _LOCAL_NAMES:
        return True
    try:
        here = socket.gethostname()
    except OSError:
        return False
    return name in (here, here.split(".")[0])


# ---- hosts that cannot be reached ------------------------------------------------------------
def check_names_resolve(hosts: Sequence[HostSlots], source: str) -> None:
    """Raise ValueError naming the first remote host whose name does not resolve, and
    ``source`` (the flag that listed it): otherwise ssh fails later, inside the MPI
    launcher or the Gloo launch, with a message that does not say which flag was wrong."""
    for host in hosts:
        if is_local_host(host.name):
            continue
        try:
            socket.getaddrinfo(host.name, None)
        except (socket.gaierror, UnicodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise ValueError(f"host {host.name} (listed by {source}) does not resolve "
                             f"({reason}): check the name in {source}") from None


# ssh's own complaints when it cannot reach a host or log in to it.
_SSH_FAILURES = (
    re.compile(rb"^ssh: connect to host (\S+) port \d+: (.+?)\s*$"),
    re.compile(rb"^ssh: Could not resolve hostname (\S+?): (.+?)\s*$"),
    re.compile(rb"^(?:\S+@)?(\S+?): (Permission denied \(.+\))\.?\s*$"),
)


def ssh_failure(line: bytes) -> Optional[Tuple[str, str]]:
    """``(host, reason)`` when ``line`` is ssh saying it could not reach or log in to a
    host, else None."""
    for pattern in _SSH_FAILURES:
        m = pattern.match(line)
        if m:
            return m.group(1).decode("utf-8", "replace"), m.group(2).decode("utf-8", "replace")
    return None


def unreachable(host: str, reason: str, source: str) -> str:
    """The summary's words for a host that ssh could not reach."""
    listed = f" (listed by {source})" if source else ""
    return f"cannot reach host {host}{listed} over ssh: {reason}"
