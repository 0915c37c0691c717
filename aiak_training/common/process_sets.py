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
        from aiak_training.common import basics
        if self.process_set_id is None or not basics.is_initialized():
            return None
        try:
            return basics._engine().process_set_info(self.process_set_id)
        except ValueError:
            return None

    def size(self) -> Optional[int]:
        """Return size of the process set or None if not initialized."""
        info = self._engine_info()
        return None if info is None else len(info[0])

    def rank(self) -> Optional[int]:
        """Return rank relative to this process set or None if not initialized.

        Returns None as well on a process that is not part of the set.
        """
        info = self._engine_info()
        return None if info is None else info[2]

    def included(self) -> Optional[bool]:
        """Return whether the current process is part of this process set or None if not initialized."""
        from aiak_training.common import basics
        if self.process_set_id is None or not basics.is_initialized():
            return None
        return basics.rank() in (self.ranks or [])

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, " \
               f"mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
