"""hier_pipelined: pipelined hierarchical allreduce with a shared-memory intra-node stage.

Design (the C++ side is csrc/native/hier.cpp, class ``HierNode``):

* **Shared memory inside the node.**  The local ranks allocate one MPI-3 shared window
  (``MPI.Win.Allocate_shared`` on the node communicator) when the algorithm is created.  Each
  rank's segment is a control page plus ``slots`` staging slots of ``chunk_bytes``.  Ranks
  copy their data into their own slot and each *owner* reduces its slice straight out of all
  the peers' slots in one pass (no messages, no intermediate copies), then everyone copies
  the finished slices back out.
* **One inter-node stream per local rank.**  Owner ``j`` (local ranks ``0 .. owners-1``,
  ``owners = min(ranks per node)``) allreduces slice ``j`` of every chunk over its cross
  communicator, so a node drives ``owners`` concurrent network flows.  In a homogeneous
  cluster every local rank is an owner.  With unequal ranks per node, local rank ``j <
  owners`` exists on every node, so its cross communicator spans all nodes; the extra ranks
  of bigger nodes contribute data and receive the result but send nothing between nodes.
  (Horovod instead funnels a heterogeneous cluster through one rank per node.)
* **Pipelining.**  The buffer is cut into chunks of ``AIAK_HIER_CHUNK_BYTES``.  While the
  engine thread is inside the MPI allreduce of chunk *i*, a C++ worker thread copies in and
  reduces chunk *i+1* and copies out chunk *i-1*.  Ranks synchronise through progress
  counters in the shared pages and a futex, so nobody busy-waits on the node.
* **Any element count.**  A chunk of ``n`` elements is split into ``owners`` slices whose
  sizes differ by at most one, so there is no tail path and no padding; empty slices are
  skipped (the same on every node, since slice sizes depend only on ``n`` and ``owners``).
* A call that fits in one chunk runs its intra-node steps on the calling thread (there is
  nothing to overlap, and a thread hand-off would only add latency).  Calls smaller than
  ``AIAK_HIER_MIN_BYTES`` use the MPI library's allreduce, which is faster for
  latency-bound sizes.
"""
from typing import Iterator, Optional, Tuple

from mpi4py import MPI

from aiak_training.allreduce._util import mpi_buf
from aiak_training.allreduce.flat import flat_allreduce
from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp, mpi_op
from aiak_training.common.env import env_bytes, env_float, env_int
from aiak_training.common.native import HierNode
from aiak_training.common.topology import Topology

# Defaults, measured on the emulated 2x2 cluster (docs/benchmarks/history.md).
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
DEFAULT_SLOTS = 4
DEFAULT_MIN_BYTES = 0
DEFAULT_TIMEOUT_S = 300.0


def chunk_spans(count: int, itemsize: int, chunk_bytes: int,
                align: int = 1) -> Iterator[Tuple[int, int]]:
    """(first element, element count) of each pipeline chunk of a ``count``-element buffer.

    The chunking rule of this algorithm (the C++ stage applies it too): whole elements,
    ``chunk_bytes`` per chunk, the last chunk takes the rest.  ``align`` rounds the chunk
    length down to a multiple (the GPU variant needs chunks that split evenly over the ranks
    of a node).
    """
    step = max(align, (max(1, chunk_bytes // itemsize) // align) * align)
    for first in range(0, count, step):
        yield first, min(step, count - first)


def shared_memory_usable(topology: Topology) -> bool:
    """Whether every node communicator can share memory.  Collective over ``topology.comm``.

    A host identity (``HOROVOD_HOSTNAME``) could group ranks of different machines into one
    "node"; then no shared window is possible and hier_pipelined must not be used.
    """
    probe = topology.local_comm.Split_type(MPI.COMM_TYPE_SHARED, key=topology.local_rank)
    ok = probe.Get_size() == topology.local_size
    probe.Free()
    return bool(topology.comm.allreduce(ok, op=MPI.LAND))


class SharedMemoryUnavailable(RuntimeError):
    """The node could not allocate the shared window (e.g. a small /dev/shm in a container)."""


def allocate_window(topology: Topology, nbytes: int) -> MPI.Win:
    """``MPI.Win.Allocate_shared`` of ``nbytes`` per rank on the node communicator, agreed on
    by every rank: raises :class:`SharedMemoryUnavailable` on all ranks if any node failed.
    Collective over ``topology.comm``."""
    win, error = None, ""
    try:
        win = MPI.Win.Allocate_shared(nbytes, 1, comm=topology.local_comm)
    except MPI.Exception as exc:
        error = str(exc)
    node_ok = topology.local_comm.allreduce(win is not None, op=MPI.LAND)
    all_ok = topology.comm.allreduce(node_ok, op=MPI.LAND)
    if all_ok:
        return win
    if node_ok:
        win.Free()  # collective on this node, where every rank holds a window
    # A node where only some ranks got a window cannot free it collectively; it is left to
    # process exit rather than risking a hang.
    raise SharedMemoryUnavailable(
        f"could not allocate {nbytes} bytes of shared memory per rank"
        + (f" ({error})" if error else " on some node"))


class PipelinedHierAllreduce:
    """Callable ``(comms, addr, count, dtype, op)`` bound to one topology; reduces in place.

    Construction is collective over ``topology.comm`` (the window is allocated on every node
    and the ranks agree that it worked); :meth:`close` is collective over each node.
    Arguments left as None come from the environment (``AIAK_HIER_*``, see docs/hierarchical-allreduce.md).
    """

    name = "hier_pipelined"

    def __init__(self, topology: Topology, chunk_bytes: Optional[int] = None,
                 slots: Optional[int] = None, min_bytes: Optional[int] = None,
                 timeout_s: Optional[float] = None, use_worker: bool = True) -> None:
        self.topology = topology
        if chunk_bytes is None:
            chunk_bytes = env_bytes("AIAK_HIER_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, minimum=64)
        if slots is None:
            slots = env_int("AIAK_HIER_SLOTS", DEFAULT_SLOTS, minimum=2)
        if min_bytes is None:
            min_bytes = env_bytes("AIAK_HIER_MIN_BYTES", DEFAULT_MIN_BYTES)
        if timeout_s is None:
            timeout_s = env_float("AIAK_HIER_TIMEOUT_S", DEFAULT_TIMEOUT_S, minimum=1.0)
        # Slots hold whole elements of every dtype and stay cache-line aligned.
        self.chunk_bytes = max(64, (int(chunk_bytes) + 63) // 64 * 64)
        self.slots = int(slots)
        self.min_bytes = int(min_bytes)
        self.owners = min(topology.node_sizes)
        segment = HierNode.control_bytes() + self.slots * self.chunk_bytes
        self._win: Optional[MPI.Win] = allocate_window(topology, segment)
        segments = [self._win.Shared_query(r)[0].address for r in range(topology.local_size)]
        HierNode.init_control(segments[topology.local_rank])
        topology.local_comm.Barrier()  # every control page is zeroed before anyone reads it
        self._node: Optional[HierNode] = HierNode(
            segments, topology.local_rank, self.owners, self.slots, self.chunk_bytes,
            float(timeout_s), use_worker)

    def __call__(self, comms: Topology, addr: int, count: int, dtype: DataType,
                 op: ReduceOp) -> None:
        if count == 0:
            return
        node = self._node
        if node is None:
            raise RuntimeError("hier_pipelined allreduce used after close()")
        if count * ITEMSIZE[dtype] < self.min_bytes:
            flat_allreduce(comms, addr, count, dtype, op)
            return
        mop = mpi_op(dtype, op)  # validates the op for the dtype before any rank starts
        nchunks = node.start(addr, count, int(dtype), int(op))
        try:
            if node.is_owner:
                cross = comms.cross_comm if comms.cross_size > 1 else None
                for c in range(nchunks):
                    slice_addr, n = node.wait_reduced(c)
                    if cross is not None and n:
                        cross.Allreduce(MPI.IN_PLACE, mpi_buf(slice_addr, n, dtype), mop)
                    node.mark_crossed(c)
        except BaseException:
            node.abort()  # wake and fail the node's other ranks instead of leaving them hung
            raise
        node.finish()

    def close(self) -> None:
        """Stop the worker thread and free the shared window (collective on the node)."""
        if self._node is not None:
            self._node.close()
            self._node = None
        if self._win is not None:
            self._win.Free()
            self._win = None

