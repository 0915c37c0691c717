"""Executing negotiated responses: fusion, scaling and the MPI data movement.

Runs on the engine thread only.  Allreduce responses that agree on dtype, op and scale
factors are fused: small tensors are packed into one reusable buffer (one MPI call), while
tensors of at least ``AIAK_ZERO_COPY_BYTES`` are reduced in place, since copying them in and
out would cost more than the extra call saves.
"""
from typing import TYPE_CHECKING, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from aiak_training.common import native
from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp, mpi_datatype, mpi_op
from aiak_training.common.messages import CONTROL_OPS, OpType, Response

if TYPE_CHECKING:
    from aiak_training.common.engine import Engine, ProcessSetState, TensorEntry

def _buf(addr: int, count: int, dtype: DataType) -> list:
    return [MPI.buffer.fromaddress(addr, count * ITEMSIZE[dtype]), count, mpi_datatype(dtype)]


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _split_rows(rows: int, size: int) -> List[int]:
    """Rows per rank for reducescatter: the first ``rows % size`` ranks get one extra."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _displacements(counts: List[int]) -> List[int]:
    return np.cumsum([0] + counts[:-1]).tolist()


def allgather_layout(resp: Response) -> Tuple[List[int], List[int], Tuple[int, ...]]:
    """Element counts and displacements per rank, and the output shape, of an allgather."""
    shapes = resp.shapes[0]
    row = _prod(shapes[0][1:])
    counts = [s[0] * row for s in shapes]
    return counts, _displacements(counts), (sum(s[0] for s in shapes),) + tuple(shapes[0][1:])


def alltoall_layout(resp: Response, me: int, size: int):
    """(send counts, send displs, recv counts, recv displs, recv rows, output shape) of this
    rank in an alltoall, in elements."""
    shape = resp.shapes[0][me]
    row = _prod(shape[1:])
    recv_rows = [resp.splits[src][me] for src in range(size)]
    send_counts = [r * row for r in resp.splits[me]]
    recv_counts = [r * row for r in recv_rows]
    return (send_counts, _displacements(send_counts), recv_counts, _displacements(recv_counts),
            recv_rows, (sum(recv_rows),) + tuple(shape[1:]))


def reducescatter_layout(resp: Response, me: int, size: int):
    """Element counts of every rank's block, and this rank's output shape."""
    shape = resp.shapes[0][me]
    rows = _split_rows(shape[0], size)
    row = _prod(shape[1:])
    return [r * row for r in rows], (rows[me],) + tuple(shape[1:])


def average_postscale(resp: Response, size: int) -> float:
    """The factor applied after the reduction: postscale, with Average's 1/size folded in
    (divided in float64 as Horovod does; native.scale then rounds it to float32 for float32
    and the half types, so results match Horovod's bit for bit)."""
    return resp.postscale / size if resp.reduce_op == ReduceOp.AVERAGE else resp.postscale


class Executor:
    def __init__(self, engine: "Engine"):
        self.engine = engine
        self._fusion = np.empty(0, dtype=np.uint8)
        self._zeros_keep: List[np.ndarray] = []
        self._gpu_executor = None

    def _gpu(self):
        """The GPU executor, made on the first GPU response (CPU-only jobs never load CUDA)."""
        if self._gpu_executor is None:
            from aiak_training.common.gpu.executor import GpuExecutor
            self._gpu_executor = GpuExecutor(self)
        return self._gpu_executor

    def forget_set(self, set_id: int) -> None:
        """A process set was removed: drop what the GPU path holds for it."""
        if self._gpu_executor is not None:
            self._gpu_executor.forget_set(set_id)

    def close(self, clean: bool) -> None:
        """The engine stops: release GPU resources (communicators, buffers, streams)."""
        if self._gpu_executor is not None:
            self._gpu_executor.close(clean)

    # ---- dispatch ----------------------------------------------------------------------
    def execute(self, state: "ProcessSetState", responses: List[Response]) -> None:
        threshold = self.engine.config.fusion_threshold
        i = 0
        while i < len(responses):
            resp = responses[i]
            if resp.op_type == OpType.ERROR:
                self._fail(state, resp)
                i += 1
                continue
            if resp.op_type in CONTROL_OPS:
                if resp.op_type == OpType.BARRIER:
                    self._finish(state, [resp])
                else:
                    self.engine.handle_control(state, resp)
                i += 1
                continue
            if self.engine.timeline.active:
                self._activity(resp, None)  # ends NEGOTIATE_<OP>
                self._activity(resp, resp.op_type.name)
            if resp.op_type == OpType.ALLREDUCE:
                group = [resp]
                key, total = resp.fusion_key, resp.nbytes
                j = i + 1
                while j < len(responses) and responses[j].fusion_key == key \
                        and total + responses[j].nbytes <= threshold:
                    total += responses[j].nbytes
                    group.append(responses[j])
                    if self.engine.timeline.active:
                        self._activity(responses[j], None)
                        self._activity(responses[j], "ALLREDUCE")
                    j += 1
                if resp.gpu:
                    self._gpu().allreduce(state, group)
                else:
                    self._allreduce(state, group)
                self.engine._notify_completions()
                i = j
                continue
            if resp.gpu:
                self._gpu().single(state, resp)
            else:
                e = self._entry(state, resp)
                self._finish(state, [resp], result=self.run_single(state, resp, e))
            i += 1
            # Wake waiters as each bucket lands, so the caller can use it while the rest of
            # the cycle's buckets are still being reduced.
            self.engine._notify_completions()
        self._zeros_keep.clear()

    # ---- bookkeeping -------------------------------------------------------------------
    def _entry(self, state: "ProcessSetState", resp: Response, index: int = 0) -> "TensorEntry":
        """This rank's entry for a response, or a zero-filled stand-in if this rank joined."""
        from aiak_training.common.engine import TensorEntry
        entry = state.entries.get(resp.names[index])
        if entry is not None:
            return entry
        shape = resp.shapes[index][state.rank]
        dtype = DataType(resp.dtype)
        zeros = np.zeros(max(1, _prod(shape)) * ITEMSIZE[dtype], dtype=np.uint8)
        self._zeros_keep.append(zeros)
        addr = zeros.ctypes.data
        scratch = np.empty(max(1, 2 * _prod(shape)) * ITEMSIZE[dtype] + 64, dtype=np.uint8)
        self._zeros_keep.append(scratch)

        def allocate(_shape, _addr=scratch.ctypes.data):
            return _addr
        return TensorEntry(resp.names[index], dtype, shape, addr, addr, allocate=allocate)

    def _finish(self, state: "ProcessSetState", responses: List[Response], result=None,
                events: Optional[dict] = None) -> None:
        """Complete the responses' entries (``events``: name -> completion cudaEvent_t).
        Takes every response of a fusion buffer at once, with the lookups hoisted: this runs
        once per tensor per step."""
        timeline = self.engine.timeline
        pop, complete = state.entries.pop, self.engine.complete
        record = state.controller.record_executed
        for resp in responses:
            for name in resp.names:
                entry = pop(name, None)
                if timeline.active:
                    timeline.end(name)
                if entry is not None:
                    complete(entry, result=result, event=events.get(name, 0) if events else 0)
                    record(resp, entry.signature)
                else:
                    record(resp, None)

    def _fail(self, state: "ProcessSetState", resp: Response) -> None:
        for name in resp.names:
            entry = state.entries.pop(name, None)
            if entry is not None:
                self.engine.complete(entry, error=resp.error)

    def _activity(self, resp_or_names, activity: Optional[str]) -> None:
        timeline = self.engine.timeline
        if not timeline.active:
            return
        names = resp_or_names if isinstance(resp_or_names, list) else resp_or_names.names
        for name in names:
            if activity is None:
                timeline.end(name)
            else:
                timeline.begin(name, activity)

    def _fusion_buffer(self, nbytes: int) -> int:
        if self._fusion.nbytes < nbytes:
            # Grow geometrically so a slowly growing workload does not reallocate every step.
            self._fusion = np.empty(max(nbytes, 2 * self._fusion.nbytes), dtype=np.uint8)
        return self._fusion.ctypes.data

    # ---- allreduce ---------------------------------------------------------------------
    def _allreduce(self, state: "ProcessSetState", group: List[Response]) -> None:
        first = group[0]
        dtype, op = DataType(first.dtype), ReduceOp(first.reduce_op)
        pre, post = first.prescale, average_postscale(first, state.size)
        zero_copy = self.engine.config.zero_copy_bytes
        packed, in_place = [], []
        get = state.entries.get
        for r in group:
            e = get(r.names[0]) or self._entry(state, r)
            (packed if e.nbytes < zero_copy else in_place).append((r, e))
        if len(packed) == 1:  # a lone small tensor gains nothing from the fusion buffer
            in_place += packed
            packed = []
        for r, e in in_place:
            self._allreduce_in_place(state, e, dtype, op, pre, post)
            # Complete each large tensor as soon as it lands, not with the whole response:
            # an overlapped optimizer can update it while the rest are still on the wire.
            self._finish(state, [r])
            self.engine._notify_completions()
        if packed:
            self._allreduce_fused(state, [e for _, e in packed], dtype, op, pre, post)
            self._finish(state, [r for r, _ in packed])

    def _allreduce_in_place(self, state, e, dtype, op, pre, post) -> None:
        if e.in_addr != e.out_addr and e.count:
            native.copy_batch([e.out_addr], [e.in_addr], [e.nbytes])
        self.reduce_host(state, [e.name], e.out_addr, e.count, dtype, op, pre, post)

    def reduce_host(self, state, names, addr, count, dtype, op, pre, post) -> None:
        """Allreduce ``count`` elements of host memory at ``addr`` in place, with the scale
        factors (``post`` already includes Average's 1/size)."""
        native.scale(addr, count, int(dtype), pre)
        self._activity(names, "MPI_ALLREDUCE")
        state.algorithm(state.topology, addr, count, dtype, op)
        self._activity(names, None)
        native.scale(addr, count, int(dtype), post)

    def _allreduce_fused(self, state, entries, dtype, op, pre, post) -> None:
        itemsize = ITEMSIZE[dtype]
        total = sum(e.nbytes for e in entries)
        base = self._fusion_buffer(total)
        offsets, off = [], 0
        for e in entries:
            offsets.append(base + off)
            off += e.nbytes
        names = [e.name for e in entries]
        self._activity(names, "MEMCPY_IN_FUSION_BUFFER")
        native.copy_batch(offsets, [e.in_addr for e in entries], [e.nbytes for e in entries])
        self._activity(names, None)
        native.scale(base, total // itemsize, int(dtype), pre)
        self._activity(names, "MPI_ALLREDUCE")
        state.algorithm(state.topology, base, total // itemsize, dtype, op)
        self._activity(names, None)
        self._activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        outs = [e.out_addr for e in entries]
        if post != 1.0:
            native.copy_scaled_batch(outs, offsets, [e.count for e in entries], int(dtype), post)
        else:
            native.copy_batch(outs, offsets, [e.nbytes for e in entries])
        self._activity(names, None)

    # ---- allgather / broadcast / alltoall / reducescatter ------------------------------
    # Each runs on an entry's host addresses and returns the handle's result; the GPU path's
    # MPI fallback runs them on staged copies.
    def run_single(self, state: "ProcessSetState", resp: Response, e: "TensorEntry"):
        return {OpType.ALLGATHER: self._allgather, OpType.BROADCAST: self._broadcast,
                OpType.ALLTOALL: self._alltoall,
                OpType.REDUCESCATTER: self._reducescatter}[resp.op_type](state, resp, e)

    def _allgather(self, state: "ProcessSetState", resp: Response, e: "TensorEntry"):
        dtype = DataType(resp.dtype)
        counts, displs, out_shape = allgather_layout(resp)
        out = e.allocate(out_shape)
        self._activity(resp, "MPI_ALLGATHER")
        if sum(counts):
            nbytes = sum(counts) * ITEMSIZE[dtype]
            recv = [MPI.buffer.fromaddress(out, nbytes), (counts, displs), mpi_datatype(dtype)]
            state.comm.Allgatherv(_buf(e.in_addr, counts[state.rank], dtype), recv)
        self._activity(resp, None)
        return out_shape

    def _broadcast(self, state: "ProcessSetState", resp: Response, e: "TensorEntry"):
        dtype = DataType(resp.dtype)
        count = e.count
        if state.rank == resp.root and e.in_addr != e.out_addr and count:
            native.copy_batch([e.out_addr], [e.in_addr], [e.nbytes])
        self._activity(resp, "MPI_BCAST")
        if count:
            state.comm.Bcast(_buf(e.out_addr, count, dtype), root=resp.root)
        self._activity(resp, None)
        return None

    def _alltoall(self, state: "ProcessSetState", resp: Response, e: "TensorEntry"):
        dtype = DataType(resp.dtype)
        send_counts, sdispl, recv_counts, rdispl, recv_rows, out_shape = \
            alltoall_layout(resp, state.rank, state.size)
        out = e.allocate(out_shape)
        t = mpi_datatype(dtype)
        item = ITEMSIZE[dtype]
        self._activity(resp, "MPI_ALLTOALL")
        state.comm.Alltoallv(
            [MPI.buffer.fromaddress(e.in_addr, sum(send_counts) * item), (send_counts, sdispl), t],
            [MPI.buffer.fromaddress(out, sum(recv_counts) * item), (recv_counts, rdispl), t])
        self._activity(resp, None)
        return out_shape, recv_rows

    def _reducescatter(self, state: "ProcessSetState", resp: Response, e: "TensorEntry"):
        dtype, op = DataType(resp.dtype), ReduceOp(resp.reduce_op)
        counts, out_shape = reducescatter_layout(resp, state.rank, state.size)
        out = e.allocate(out_shape)
        src = e.in_addr
        if resp.prescale != 1.0 and e.count:
            src = self._fusion_buffer(e.nbytes)
            native.copy_batch([src], [e.in_addr], [e.nbytes])
            native.scale(src, e.count, int(dtype), resp.prescale)
        self._activity(resp, "MPI_REDUCESCATTER")
        if e.count:
            state.comm.Reduce_scatter(_buf(src, e.count, dtype),
                                      _buf(out, counts[state.rank], dtype),
                                      recvcounts=counts, op=mpi_op(dtype, op))
        self._activity(resp, None)
        native.scale(out, counts[state.rank], int(dtype), average_postscale(resp, state.size))
        return out_shape
