"""Process sets: groups of ranks that run collectives among themselves.

A :class:`ProcessSet` is a description until the runtime registers it (through
``init(process_sets=[...])`` or ``add_process_set``); then it has an id, and collectives
given ``process_set=`` involve only its ranks, with their own communicator and negotiation.
"""
from typing import List, Optional, Sequence, Union

from mpi4py import MPI

from aiak_training.common import horovod_strings as hs
from aiak_training.runtime import current


class ProcessSet:
    """A set of ranks, given as a list of global ranks or as an mpi4py communicator.

    ``process_set_id`` is None until the set is registered.  Collectives still name root
    ranks by their global rank (``hvd.rank()``), not by the rank within the set.
    """

    process_set_id: Optional[int] = None
    ranks: Optional[List[int]] = None
    mpi_comm: Optional[MPI.Comm] = None

    def __init__(self, ranks_or_comm: Union[Sequence[int], MPI.Comm]):
        self.process_set_id = None
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            self.ranks = None
        else:
            ranks = list(ranks_or_comm)
            if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
                raise ValueError(f"ProcessSet ranks must be integers, got {ranks!r}.")
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"ProcessSet ranks contain duplicates: {ranks!r}.")
            self.ranks = sorted(ranks)
            self.mpi_comm = None

    def resolve_ranks(self, world: MPI.Comm) -> List[int]:
        """The set's ranks in ``world``; a set given as a communicator learns them here (a
        local call, not a collective)."""
        if self.ranks is None:
            group, world_group = self.mpi_comm.Get_group(), world.Get_group()
            self.ranks = sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                          world_group))
            group.Free()
            world_group.Free()
        return self.ranks

    def _engine_view(self):
        """(ranks, size, rank in the set) as the running engine knows the set."""
        running = current.engine()
        try:
            return running.process_set_info(self.process_set_id)
        except ValueError as exc:
            raise ValueError(hs.UNKNOWN_PROCESS_SET) from exc

    def size(self) -> Optional[int]:
        """How many ranks the set has; None before it is registered."""
        if self.process_set_id is None:
            return None
        return self._engine_view()[1]

    def rank(self) -> Optional[int]:
        """This process's index within the set (the order of ``hvd.allgather`` results); None
        before the set is registered; ``ValueError`` on a process outside the set."""
        if self.process_set_id is None:
            return None
        rank = self._engine_view()[2]
        if rank is None:
            raise ValueError(hs.NOT_IN_PROCESS_SET)
        return rank

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set; None while its ranks are unknown."""
        if self.ranks is None:
            return None
        return current.topology().rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, " \
               f"mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
