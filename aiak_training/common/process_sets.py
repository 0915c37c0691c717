"""Process sets: subsets of ranks with their own communicator and negotiation."""
from typing import List, Optional, Sequence, Union

from mpi4py import MPI


class ProcessSet:
    """Representation of a set of Horovod processes that will run collective operations together.

    Initialize a ProcessSet with a list of process ranks or an MPI communicator. Then pass this
    instance to hvd.init() or hvd.add_process_set(). If a valid process set has been
    initialized, process_set_id will be set to a numeric value.
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

    def _resolve_ranks(self, world: MPI.Comm) -> List[int]:
        """Ranks in ``world`` of a communicator-defined set (a local, non-collective call)."""
        if self.ranks is None:
            group, world_group = self.mpi_comm.Get_group(), world.Get_group()
            self.ranks = sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                          world_group))
            group.Free()
            world_group.Free()
        return self.ranks

    def _engine_info(self):
        """(ranks, size, rank in set) from the engine; raises Horovod's errors."""
        from aiak_training.common import basics
        if not basics.is_initialized():
            raise ValueError(basics.NOT_INITIALIZED_MESSAGE)
        try:
            return basics._engine().process_set_info(self.process_set_id)
        except ValueError:
            raise ValueError("Process set does not exist or has not been registered.") from None

    def size(self) -> Optional[int]:
        """Return size of the process set or None if not initialized."""
        if self.process_set_id is None:
            return None
        return self._engine_info()[1]

    def rank(self) -> Optional[int]:
        """Return rank relative to this process set or None if not initialized.

        This is useful, e.g., to process the result of hvd.allgather().

        Please note that, even with process sets, Horovod operations like hvd.broadcast() are
        not parameterized by this relative rank, but by the global rank as obtained from
        hvd.rank().
        """
        if self.process_set_id is None:
            return None
        rank = self._engine_info()[2]
        if rank is None:
            raise ValueError("Process is not part of provided process set.")
        return rank

    def included(self) -> Optional[bool]:
        """Return whether the current process is part of this process set or None if not initialized."""
        if self.ranks is None:
            return None
        from aiak_training.common import basics
        return basics.rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, " \
               f"mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
