"""The NCCL side of the GPU executor: which transport a process set's GPU collectives take,
and the NCCL calls that run a response on the device.

:func:`agree_transport` is collective over the set's ranks (on its first GPU response); the
rest only enqueues work on the stream it is given.  See
:mod:`aiak_training.runtime.execute.gpu_executor` for how the transports are chosen.
"""
import logging
import socket
from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple

from aiak_training.allreduce.hier_nccl import (Reduction, hier_chunk_bytes, hier_overlap,
                                               nccl_hier_allreduce)
from aiak_training.common.config import Config
from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp
from aiak_training.common.gpu import nccl
from aiak_training.common.messages import OpType, Response
from aiak_training.runtime.entries import SetState, TensorEntry
from aiak_training.runtime.execute.layouts import (allgather_layout, alltoall_layout,
                                                   reducescatter_layout)

log = logging.getLogger("aiak_training")

#: What :func:`nccl_single` returns for a collective NCCL cannot run here.
UNSUPPORTED = object()


@dataclass
class SetContext:
    """What one process set uses on the GPU: its transport and NCCL communicators."""
    transport: str
    reason: str
    device: int
    comms: Dict[str, nccl.Communicator] = field(default_factory=dict)
    hier: bool = False
    local_rank: int = 0
    local_size: int = 1
    nccl_version: int = 0
    zero_copy_bytes: int = 0
    chunk_bytes: int = 0
    overlap: bool = True


def check_async_errors(ctx: SetContext) -> None:
    """Raise if NCCL reported an asynchronous error on one of the set's communicators (a
    peer failed)."""
    for comm in ctx.comms.values():
        error = comm.async_error()
        if error is not None:
            raise nccl.NcclError(f"NCCL reported an asynchronous error: {error}")


def agree_transport(state: SetState, config: Config, rt, device: int) -> SetContext:
    """The set's GPU transport, agreed by all its ranks, with its NCCL communicators made
    (collective over the set).  ``device`` is this rank's CUDA device."""
    want = config.gpu_transport
    problem = None
    lib = None
    if want == "nccl":
        try:
            lib = nccl.library()
        except nccl.NcclError as exc:
            problem = str(exc)
    where = (socket.gethostname(), rt.device_uuid(device))
    # Settings that decide how many NCCL calls a response makes must agree on every
    # rank, or the calls would not match: rank 0's values (the lowest NCCL version) win.
    settings = (lib.version if lib is not None else 0, config.zero_copy_bytes,
                hier_chunk_bytes(), hier_overlap())
    views = state.comm.allgather((where, want, problem, settings))
    transport, reason = "nccl", f"NCCL {nccl.nccl_version_text(lib)}"
    owners: Dict[tuple, int] = {}
    for r, (gpu, w, p, _) in enumerate(views):
        if w == "mpi":
            transport, reason = "mpi", "AIAK_GPU_TRANSPORT=mpi or HOROVOD_GPU_OPERATIONS=MPI"
            break
        if p is not None:
            transport, reason = "mpi", f"rank {r} cannot use NCCL: {p}"
            break
        if gpu in owners:
            transport, reason = "mpi", (f"ranks {owners[gpu]} and {r} share GPU {gpu[1]} on "
                                        f"{gpu[0]}, and NCCL needs one GPU per rank")
            break
        owners[gpu] = r
    ctx = SetContext(transport, reason, device, local_rank=state.topology.local_rank,
                     local_size=state.topology.local_size,
                     nccl_version=min(v[3][0] for v in views),
                     zero_copy_bytes=views[0][3][1], chunk_bytes=views[0][3][2],
                     overlap=views[0][3][3])
    if transport == "nccl":
        ctx.comms["global"] = nccl.Communicator.create(lib, state.comm)
        topo = state.topology
        ctx.hier = (getattr(state.algorithm, "name", "flat") != "flat"
                    and topo.num_nodes > 1 and topo.is_homogeneous and topo.local_size > 1)
        if ctx.hier:
            ctx.comms["local"] = nccl.Communicator.create(lib, topo.local_comm)
            ctx.comms["cross"] = nccl.Communicator.create(lib, topo.cross_comm)
    if state.rank == 0:
        (log.info if transport == "nccl" or want == "mpi" else log.warning)(
            "GPU collectives of process set %d use %s (%s)%s", state.id, transport, reason,
            "; hierarchical allreduce on NCCL" if ctx.hier else "")
    return ctx


def hierarchical(ctx: SetContext, op: int, dtype: DataType) -> bool:
    # ncclAvg composes over the two levels only for floats (integer division truncates).
    return ctx.hier and (op != nccl.AVG or dtype in (DataType.FLOAT16, DataType.BFLOAT16,
                                                     DataType.FLOAT32, DataType.FLOAT64))


def flat_allreduce(ctx: SetContext, calls, dtype: DataType, plan, stream: int) -> None:
    """The allreduces of one response on the global communicator: one reduction op for
    all of them, and one NCCL group (one launch) when there are several."""
    op, factor = plan
    nccl_dtype = nccl.NCCL_DTYPE[dtype]
    comm = ctx.comms["global"]
    # The group ends before the custom op is destroyed: NCCL enqueues grouped calls at
    # ncclGroupEnd, and the op must outlive them.
    with Reduction(comm, op, factor, nccl_dtype) as nccl_op:
        if len(calls) == 1:
            send, recv, count = calls[0]
            comm.allreduce(send, recv, count, nccl_dtype, nccl_op, stream)
            return
        comm.lib.group_start()
        try:
            for send, recv, count in calls:
                comm.allreduce(send, recv, count, nccl_dtype, nccl_op, stream)
        finally:
            comm.lib.group_end()


def hier_allreduce(rt, ctx: SetContext, send: int, recv: int, count: int, dtype: DataType,
                   plan, stream: int, cross_stream: int) -> None:
    """One allreduce over the node-local and cross-node communicators, in place in
    ``recv``; ``cross_stream`` runs the cross-node part when it overlaps the local one."""
    op, factor = plan
    if send != recv:
        rt.memcpy_async(recv, send, count * ITEMSIZE[dtype], stream)
    nccl_hier_allreduce(rt, ctx.comms, recv, count, ITEMSIZE[dtype], nccl.NCCL_DTYPE[dtype], op,
                        factor, stream, cross_stream, ctx.local_rank, ctx.local_size,
                        ctx.chunk_bytes)


def nccl_single(ctx: SetContext, state: SetState, resp: Response, e: TensorEntry, stream: int,
                allocate: Callable[[TensorEntry, Tuple[int, ...], int], int]):
    """Enqueue a broadcast, allgather, alltoall or reducescatter on NCCL; its result for
    the completer, or :data:`UNSUPPORTED` when NCCL cannot run it (the staged path then
    does).  ``allocate(entry, shape, stream)`` gives the output's device address."""
    dtype = DataType(resp.dtype)
    if not nccl.supports(dtype):
        return UNSUPPORTED
    comm, nd, item = ctx.comms["global"], nccl.NCCL_DTYPE[dtype], ITEMSIZE[dtype]
    lib, me = comm.lib, state.rank
    if resp.op_type == OpType.BROADCAST:
        if e.count:
            comm.broadcast(e.in_addr, e.out_addr, e.count, nd, resp.root, stream)
        return None
    if resp.op_type == OpType.ALLGATHER:
        counts, displs, out_shape = allgather_layout(resp)
        out = allocate(e, out_shape, stream)
        if len(set(counts)) == 1:
            if counts[0]:
                comm.allgather(e.in_addr, out, counts[0], nd, stream)
        else:  # first dimensions differ: one broadcast per rank, as one NCCL group
            lib.group_start()
            try:
                for r, (n, d) in enumerate(zip(counts, displs)):
                    if n:
                        comm.broadcast(e.in_addr, out + d * item, n, nd, r, stream)
            finally:
                lib.group_end()
        return out_shape
    if resp.op_type == OpType.ALLTOALL:
        if ctx.nccl_version < 20700:  # no ncclSend/ncclRecv
            return UNSUPPORTED
        send, sdispl, recv, rdispl, recv_rows, out_shape = alltoall_layout(resp, me, state.size)
        out = allocate(e, out_shape, stream)
        lib.group_start()
        try:
            for r in range(state.size):
                if send[r]:
                    comm.send(e.in_addr + sdispl[r] * item, send[r], nd, r, stream)
                if recv[r]:
                    comm.recv(out + rdispl[r] * item, recv[r], nd, r, stream)
        finally:
            lib.group_end()
        return out_shape, recv_rows
    # REDUCESCATTER
    plan = nccl.plan_reduction(dtype, ReduceOp(resp.reduce_op), resp.prescale,
                               resp.postscale, state.size, ctx.nccl_version)
    if plan is None:
        return UNSUPPORTED
    counts, out_shape = reducescatter_layout(resp, me, state.size)
    out = allocate(e, out_shape, stream)
    if not e.count:
        return out_shape
    with Reduction(comm, plan[0], plan[1], nd) as op:
        if len(set(counts)) == 1:
            comm.reduce_scatter(e.in_addr, out, counts[0], nd, op, stream)
        else:  # uneven blocks: one reduce per rank, as one NCCL group
            lib.group_start()
            try:
                off = 0
                for r, n in enumerate(counts):
                    if n:
                        comm.reduce(e.in_addr + off * item, out, n, nd, op, r, stream)
                    off += n
            finally:
                lib.group_end()
    return out_shape
