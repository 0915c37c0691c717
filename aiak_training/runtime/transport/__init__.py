"""The engine's transport: the one interface negotiation and data movement talk through.

The engine (``runtime/engine.py`` and, through ``gloo_calls.py``, the C++ negotiation of
``csrc/engine/``), the executors (``runtime/execute/executor.py``,
``runtime/execute/host_collectives.py``), the topology (``common/topology.py``), the flat
allreduce and the watchdog use a
communicator object with exactly the methods of :class:`Comm` below, named and
called as in mpi4py.  Two implementations:

* **MPI**: an ``mpi4py.MPI.Comm`` itself.  Nothing is wrapped, so the MPI path costs what it
  cost before a second transport existed.
* **Gloo**: :class:`aiak_training.runtime.transport.gloo_comm.GlooComm`, which runs the same
  calls on ``torch.distributed``'s Gloo process groups over a ``TCPStore`` rendezvous
  (``gloo.py`` forms the world).

Keeping mpi4py's calling convention (buffer specs ``[buffer, count, datatype]``, ``MPI.IN_PLACE``,
``MPI.COMM_NULL`` for "not a member") means negotiation, fusion, the response cache, process
sets, the timeline and error reporting stay one implementation; only what is below this
interface differs.  Which transport ``hvd.init()`` uses is decided by :func:`gloo_selected`.
"""
from typing import Any, List, Optional, Protocol, Sequence

from aiak_training.runtime.transport.gloo import (WorldInfo, gloo_selected,  # noqa: F401
                                                  set_world_source, start_rendezvous_server,
                                                  world_from_env)


class Group(Protocol):
    """What ``Comm.Get_group()`` returns: enough to pick members for ``Comm.Create``."""

    def Incl(self, ranks: Sequence[int]) -> "Group": ...

    def Free(self) -> None: ...


class Comm(Protocol):
    """The communicator subset the engine uses (mpi4py names and semantics).

    Collectives (everything but ``Get_rank``/``Get_size``/``Set_errhandler``/``Free``) must be
    called by every member, in the same order.  Buffer arguments are mpi4py buffer specs:
    a numpy array, or ``[buffer, count, datatype]`` / ``[buffer, (counts, displs), datatype]``
    with a datatype from :func:`aiak_training.common.dtypes.mpi_datatype`, and reduce ops from
    :func:`aiak_training.common.dtypes.mpi_op`.
    """

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def Set_errhandler(self, errhandler: Any) -> None: ...

    def Dup(self) -> "Comm": ...

    def Free(self) -> None: ...

    def Split(self, color: int = 0, key: int = 0) -> "Comm": ...

    def Split_type(self, split_type: int, key: int = 0) -> "Comm": ...

    def Get_group(self) -> Group: ...

    def Create(self, group: Group) -> "Comm": ...

    # pickled Python objects: negotiation, topology, watchdog peer exchange
    def allgather(self, obj: Any) -> List[Any]: ...

    def gather(self, obj: Any, root: int = 0) -> Optional[List[Any]]: ...

    def bcast(self, obj: Any, root: int = 0) -> Any: ...

    def barrier(self) -> None: ...

    # raw memory: the data path
    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None: ...

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None: ...

    def Bcast(self, buf: Any, root: int = 0) -> None: ...

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None: ...

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]] = None,
                       op: Any = None) -> None: ...


def transport_name(comm: Any) -> str:
    """``"gloo"`` or ``"mpi"``: which implementation ``comm`` is."""
    return getattr(comm, "transport", "mpi")

