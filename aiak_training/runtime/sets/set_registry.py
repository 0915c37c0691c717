"""This rank's process sets, as the engine runs them.

The sets this rank belongs to have a :class:`SetState` (communicator, topology, allreduce
algorithm, the lane's entries); of the others only the ranks are known, so that ids stay the
same on every rank.  Creating a set is a collective over the global set, called in the same
order on every rank (at start-up, or by the engine thread for ``hvd.add_process_set``).
"""
import threading
from typing import Any, Dict, List, Optional, Tuple

from mpi4py import MPI

from aiak_training.allreduce import select_algorithm
from aiak_training.common.config import Config
from aiak_training.common.topology import build_topology
from aiak_training.runtime.entries import SetState


class ProcessSetRegistry:
    def __init__(self, config: Config):
        self._config = config
        self._lock = threading.Lock()
        self._sets: Dict[int, SetState] = {}
        self._foreign: Dict[int, List[int]] = {}  # sets this rank is not in
        self._next_id = 1

    def register(self, set_id: int, ranks: List[int], comm: Any) -> SetState:
        """Record a set this rank belongs to, over ``comm`` (which it now owns)."""
        topo = build_topology(comm)
        state = SetState(id=set_id, ranks=ranks, comm=comm, topology=topo,
                         algorithm=select_algorithm(self._config, topo, is_global=set_id == 0))
        with self._lock:
            self._sets[set_id] = state
        return state

    def create(self, ranks: List[int]) -> Tuple[int, Optional[Any]]:
        """Split the global communicator for ``ranks`` (a collective over the global set):
        (the new set's id, its communicator, or None where this rank is not a member, in
        which case the set is recorded here as foreign)."""
        world = self._sets[0].comm
        group = world.Get_group().Incl(ranks)
        comm = world.Create(group)
        group.Free()
        with self._lock:
            set_id = self._next_id
            self._next_id += 1
            if comm == MPI.COMM_NULL:
                self._foreign[set_id] = ranks
                return set_id, None
        return set_id, comm

    def remove(self, set_id: int) -> Tuple[bool, Optional[SetState]]:
        """Forget a set: (whether it was registered, its state where this rank is in it)."""
        with self._lock:
            if self._foreign.pop(set_id, None) is not None:
                return True, None
            state = self._sets.pop(set_id, None)
        return state is not None, state

    def get(self, set_id: int) -> Optional[SetState]:
        """A set this rank is in, else None.  Lock-free, for the submission path: a dict
        read is atomic, and a set's state is never replaced once registered."""
        return self._sets.get(set_id)

    def states(self) -> List[SetState]:
        with self._lock:
            return list(self._sets.values())

    def foreign_count(self) -> int:
        return len(self._foreign)

    def info(self, set_id: int) -> Tuple[List[int], Optional[int], Optional[int]]:
        """(ranks, size, rank-in-set) of a registered set; rank None if not a member."""
        with self._lock:
            state = self._sets.get(set_id)
            if state is not None:
                return state.ranks, state.size, state.rank
            if set_id in self._foreign:
                return self._foreign[set_id], len(self._foreign[set_id]), None
        raise ValueError(f"Process set {set_id} is not registered.")

    def table(self) -> Dict[int, List[int]]:
        """Every registered set's id and ranks, this rank a member or not."""
        with self._lock:
            table = {set_id: list(ranks) for set_id, ranks in self._foreign.items()}
            table.update({set_id: list(state.ranks) for set_id, state in self._sets.items()})
        return table

    def find(self, ranks: List[int]) -> Optional[int]:
        """The id of the registered set with exactly ``ranks``, or None."""
        with self._lock:
            for set_id, state in self._sets.items():
                if state.ranks == ranks:
                    return set_id
            for set_id, others in self._foreign.items():
                if others == ranks:
                    return set_id
        return None

    def ids(self) -> List[int]:
        with self._lock:
            return sorted(set(self._sets) | set(self._foreign))
