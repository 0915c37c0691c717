"""Executing negotiated responses: fusion, scaling and the MPI data movement.

Runs on the engine thread only.  Allreduce responses that agree on dtype, op and scale
factors are fused: small tensors are packed into one reusable buffer (one MPI call), while
tensors of at least ``AIAK_ZERO_COPY_BYTES`` are reduced in place, since copying them in and
out would cost more than the extra call saves.
"""
from typing import Callable, List

import numpy as np
from mpi4py import MPI

from aiak_training.allreduce._util import allgather_counts
from aiak_training.allreduce.adasum import adasum_allreduce
from aiak_training.allreduce.hier_scatter import hier_scatter, hierarchical_applies
from aiak_training.common import native
from aiak_training.common.config import Config
from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp, mpi_datatype, mpi_op
from aiak_training.common.messages import CONTROL_OPS, OpType, Response
from aiak_training.runtime.completion import Completer
from aiak_training.runtime.entries import SetState, TensorEntry
from aiak_training.runtime.layouts import (allgather_layout, alltoall_layout, average_postscale,
                                           prod, reducescatter_layout)

def _buf(addr: int, count: int, dtype: DataType) -> list:
    return [MPI.buffer.fromaddress(addr, count * ITEMSIZE[dtype]), count, mpi_datatype(dtype)]


class Executor:
    """Runs the responses of a cycle on this rank, in the agreed order.

    ``control(state, response)`` carries out control responses (join, barrier, process-set
    changes), which belong to the engine; ``join_device()`` is the CUDA device named by
    ``hvd.join`` (-1 if none), where a joined rank's zeros go; ``gpu_factory(self)`` makes
    the GPU executor when the first GPU response arrives.
    """

    def __init__(self, config: Config, completer: Completer,
                 control: Callable[[SetState, Response], None],
                 join_device: Callable[[], int], gpu_factory: Callable[["Executor"], object]):
        self.config = config
        self.completer = completer
        self.control = control
        self.join_device = join_device
        self._fusion = np.empty(0, dtype=np.uint8)
        self._zeros_keep: List[np.ndarray] = []
        self._gpu_factory = gpu_factory
        self._gpu_executor = None

    def _gpu(self):
        """The GPU executor, made on the first GPU response (CPU-only jobs never load CUDA)."""
        if self._gpu_executor is None:
            self._gpu_executor = self._gpu_factory(self)
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
    def execute(self, state: SetState, responses: List[Response]) -> None:
        threshold = self.config.fusion_threshold
        done = self.completer
        tracing = done.timeline.active
        i = 0
        while i < len(responses):
            resp = responses[i]
            if resp.op_type == OpType.ERROR:
                done.fail(state, resp.names, resp.error)
                i += 1
                continue
            if resp.op_type in CONTROL_OPS:
                self.control(state, resp)
                i += 1
                continue
            if tracing:
                done.activity(resp, None)  # ends NEGOTIATE_<OP>
                done.activity(resp, resp.op_type.name)
            if resp.op_type == OpType.ALLREDUCE:
                group = [resp]
                key, total = resp.fusion_key, resp.nbytes
                j = i + 1
                while j < len(responses) and responses[j].fusion_key == key \
                        and total + responses[j].nbytes <= threshold:
                    total += responses[j].nbytes
                    group.append(responses[j])
                    if tracing:
                        done.activity(responses[j], None)
                        done.activity(responses[j], "ALLREDUCE")
                    j += 1
                if resp.gpu:
                    self._gpu().allreduce(state, group)
                else:
                    self._allreduce(state, group)
                done.notify()
                i = j
                continue
            if resp.gpu:
                self._gpu().single(state, resp)
            else:
                e = self._entry(state, resp)
                done.finish(state, [resp], result=self.run_single(state, resp, e))
            i += 1
            # Wake waiters as each bucket lands, so the caller can use it while the rest of
            # the cycle's buckets are still being reduced.
            done.notify()
        self._zeros_keep.clear()

    # ---- bookkeeping -------------------------------------------------------------------
    def _entry(self, state: SetState, resp: Response, index: int = 0) -> TensorEntry:
        """This rank's entry for a response, or a zero-filled stand-in if this rank joined."""
        entry = state.entries.get(resp.names[index])
        if entry is not None:
            return entry
        shape = resp.shapes[index][state.rank]
        dtype = DataType(resp.dtype)
        zeros = np.zeros(max(1, prod(shape)) * ITEMSIZE[dtype], dtype=np.uint8)
        self._zeros_keep.append(zeros)
        addr = zeros.ctypes.data
        scratch = np.empty(max(1, 2 * prod(shape)) * ITEMSIZE[dtype] + 64, dtype=np.uint8)
        self._zeros_keep.append(scratch)

        def allocate(_shape, _addr=scratch.ctypes.data):
            return _addr
        return TensorEntry(resp.names[index], dtype, shape, addr, addr, allocate=allocate)

    @property
    def fusion_buffer_bytes(self) -> int:
        """Size of the reusable fusion buffer: it only grows, to the largest fused batch."""
        return self._fusion.nbytes

    def _fusion_buffer(self, nbytes: int) -> int:
        if self._fusion.nbytes < nbytes:
            # Grow geometrically so a slowly growing workload does not reallocate every step.
            self._fusion = np.empty(max(nbytes, 2 * self._fusion.nbytes), dtype=np.uint8)
        return self._fusion.ctypes.data

    # ---- allreduce ---------------------------------------------------------------------
    def _allreduce(self, state: SetState, group: List[Response]) -> None:
        first = group[0]
        dtype, op = DataType(first.dtype), ReduceOp(first.reduce_op)
        pre, post = first.prescale, average_postscale(first, state.size)
        zero_copy = self.config.zero_copy_bytes
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
            self.completer.finish(state, [r])
            self.completer.notify()
        if packed:
            self._allreduce_fused(state, [e for _, e in packed], dtype, op, pre, post)
            self.completer.finish(state, [r for r, _ in packed])

    def _allreduce_in_place(self, state, e, dtype, op, pre, post) -> None:
        if e.in_addr != e.out_addr and e.count:
            native.copy_batch([e.out_addr], [e.in_addr], [e.nbytes])
        self.reduce_host(state, [e.name], e.out_addr, e.count, dtype, op, pre, post)

    def reduce_host(self, state, names, addr, count, dtype, op, pre, post) -> None:
        """Allreduce ``count`` elements of host memory at ``addr`` in place, with the scale
        factors (``post`` already includes Average's 1/size)."""
        native.scale(addr, count, int(dtype), pre)
        self.completer.activity(names, "MPI_ALLREDUCE")
        self._reduce(state, addr, [count], dtype, op)
        self.completer.activity(names, None)
        native.scale(addr, count, int(dtype), post)

    @staticmethod
    def _reduce(state, addr: int, counts: List[int], dtype: DataType, op: ReduceOp) -> None:
        """Run the set's algorithm on tensors of ``counts`` elements laid end to end; Adasum
        needs the tensor boundaries (per-tensor coefficients), the others only the total."""
        if op == ReduceOp.ADASUM:
            adasum_allreduce(state.topology, addr, counts, dtype)
        else:
            state.algorithm(state.topology, addr, sum(counts), dtype, op)

    def _allreduce_fused(self, state, entries, dtype, op, pre, post) -> None:
        itemsize = ITEMSIZE[dtype]
        total = sum(e.nbytes for e in entries)
        base = self._fusion_buffer(total)
        offsets, off = [], 0
        for e in entries:
            offsets.append(base + off)
            off += e.nbytes
        names = [e.name for e in entries]
        self.completer.activity(names, "MEMCPY_IN_FUSION_BUFFER")
        native.copy_batch(offsets, [e.in_addr for e in entries], [e.nbytes for e in entries])
        self.completer.activity(names, None)
        native.scale(base, total // itemsize, int(dtype), pre)
        self.completer.activity(names, "MPI_ALLREDUCE")
        self._reduce(state, base, [e.count for e in entries], dtype, op)
        self.completer.activity(names, None)
        self.completer.activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        outs = [e.out_addr for e in entries]
        if post != 1.0:
            native.copy_scaled_batch(outs, offsets, [e.count for e in entries], int(dtype), post)
        else:
            native.copy_batch(outs, offsets, [e.nbytes for e in entries])
        self.completer.activity(names, None)

    # ---- allgather / broadcast / alltoall / reducescatter ------------------------------
    # Each runs on an entry's host addresses and returns the handle's result; the GPU path's
    # MPI fallback runs them on staged copies.
    def run_single(self, state: SetState, resp: Response, e: TensorEntry):
        return {OpType.ALLGATHER: self._allgather, OpType.BROADCAST: self._broadcast,
                OpType.ALLTOALL: self._alltoall,
                OpType.REDUCESCATTER: self._reducescatter}[resp.op_type](state, resp, e)

    def _hier(self, state: SetState):
        """The set's two-level reduce-scatter/allgather, or None where they run flat."""
        if hierarchical_applies(self.config, state.topology, state.id == 0):
            return hier_scatter(state.topology)
        return None

    def _allgather(self, state: SetState, resp: Response, e: TensorEntry):
        dtype = DataType(resp.dtype)
        counts, _, out_shape = allgather_layout(resp)
        out = e.allocate(out_shape)
        self.completer.activity(resp, "MPI_ALLGATHER")
        if sum(counts):
            hier = self._hier(state)
            if hier is not None:
                hier.allgather(e.in_addr, out, counts, dtype)
            else:
                allgather_counts(state.comm, e.in_addr, out, counts, dtype)
        self.completer.activity(resp, None)
        return out_shape

    def _broadcast(self, state: SetState, resp: Response, e: TensorEntry):
        dtype = DataType(resp.dtype)
        count = e.count
        if state.rank == resp.root and e.in_addr != e.out_addr and count:
            native.copy_batch([e.out_addr], [e.in_addr], [e.nbytes])
        self.completer.activity(resp, "MPI_BCAST")
        if count:
            state.comm.Bcast(_buf(e.out_addr, count, dtype), root=resp.root)
        self.completer.activity(resp, None)
        return None

    def _alltoall(self, state: SetState, resp: Response, e: TensorEntry):
        dtype = DataType(resp.dtype)
        send_counts, sdispl, recv_counts, rdispl, recv_rows, out_shape = \
            alltoall_layout(resp, state.rank, state.size)
        out = e.allocate(out_shape)
        t = mpi_datatype(dtype)
        item = ITEMSIZE[dtype]
        self.completer.activity(resp, "MPI_ALLTOALL")
        state.comm.Alltoallv(
            [MPI.buffer.fromaddress(e.in_addr, sum(send_counts) * item), (send_counts, sdispl), t],
            [MPI.buffer.fromaddress(out, sum(recv_counts) * item), (recv_counts, rdispl), t])
        self.completer.activity(resp, None)
        return out_shape, recv_rows

    def _reducescatter(self, state: SetState, resp: Response, e: TensorEntry):
        dtype, op = DataType(resp.dtype), ReduceOp(resp.reduce_op)
        counts, out_shape = reducescatter_layout(resp, state.rank, state.size)
        out = e.allocate(out_shape)
        post = average_postscale(resp, state.size)
        self.completer.activity(resp, "MPI_REDUCESCATTER")
        hier = self._hier(state) if e.count else None
        if hier is not None:
            hier.reducescatter(e.in_addr, out, counts, dtype, op, resp.prescale, post)
            self.completer.activity(resp, None)
            return out_shape
        src = e.in_addr
        if resp.prescale != 1.0 and e.count:
            # One pass: the input is the caller's and stays unscaled.
            src = self._fusion_buffer(e.nbytes)
            native.copy_scaled_batch([src], [e.in_addr], [e.count], int(dtype), resp.prescale)
        if e.count:
            state.comm.Reduce_scatter(_buf(src, e.count, dtype),
                                      _buf(out, counts[state.rank], dtype),
                                      recvcounts=counts, op=mpi_op(dtype, op))
        self.completer.activity(resp, None)
        native.scale(out, counts[state.rank], int(dtype), post)
        return out_shape
