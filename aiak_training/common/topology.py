"""Who is where: global, local (same node) and cross (same local rank) communicators.

Node grouping comes from a shared-memory split, unless ranks carry a host identity
(``HOROVOD_HOSTNAME``), which lets tests and emulated clusters define virtual nodes.
"""
import os
import socket
from dataclasses import dataclass, field
from typing import Callable, List

from mpi4py import MPI


@dataclass
class Topology:
    comm: MPI.Comm
    local_comm: MPI.Comm
    cross_comm: MPI.Comm
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostnames: List[str]      # per global rank, as used for grouping ("" if from shm split)
    node_sizes: List[int]     # ranks per node, in node order
    is_homogeneous: bool
    # Called (last added first) by free() before the communicators go, e.g. to free an
    # algorithm's shared window on local_comm.
    finalizers: List[Callable[[], None]] = field(default_factory=list)

    def add_finalizer(self, fn: Callable[[], None]) -> None:
        self.finalizers.append(fn)

    @property
    def num_nodes(self) -> int:
        return len(self.node_sizes)

    def free(self) -> None:
        while self.finalizers:
            try:
                self.finalizers.pop()()
            except MPI.Exception:
                pass
        for c in (self.cross_comm, self.local_comm, self.comm):
            if c != MPI.COMM_NULL:
                try:
                    c.Free()
                except MPI.Exception:
                    pass


def build_topology(comm: MPI.Comm) -> Topology:
    """Collective over ``comm``: split it into node-local and cross-node communicators."""
    rank, size = comm.Get_rank(), comm.Get_size()
    identity = os.environ.get("HOROVOD_HOSTNAME") or None
    identities = comm.allgather(identity)
    if any(h is not None for h in identities):
        names = comm.allgather(identity or socket.gethostname())
        order = list(dict.fromkeys(names))
        local_comm = comm.Split(color=order.index(names[rank]), key=rank)
    else:
        names = [""] * size
        local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local_comm.Get_rank(), local_comm.Get_size()
    cross_comm = comm.Split(color=local_rank, key=rank)
    # Node index of each rank = cross rank of that node's local rank 0.
    node_of = comm.allgather((local_rank, cross_comm.Get_rank() if local_rank == 0 else -1,
                              local_size))
    leaders = [(r, info) for r, info in enumerate(node_of) if info[0] == 0]
    node_sizes = [info[2] for _, info in sorted(leaders, key=lambda x: x[1][1])]
    return Topology(comm=comm, local_comm=local_comm, cross_comm=cross_comm, rank=rank,
                    size=size, local_rank=local_rank, local_size=local_size,
                    cross_rank=cross_comm.Get_rank(), cross_size=cross_comm.Get_size(),
                    hostnames=names, node_sizes=node_sizes,
                    is_homogeneous=len(set(node_sizes)) == 1)
