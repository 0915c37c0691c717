"""Executing the responses the C++ engine hands to Python, in the agreed order.

The engine's own thread runs flat host allreduces and broadcasts in C++; it calls the lane
(runtime/engine.py) with the responses that need Python: GPU collectives, allgather, alltoall,
reducescatter, process-set changes, Adasum and the hierarchical allreduce algorithms.  This
module runs them.  CUDA allreduces arrive already fused by the C++ thread; other allreduce
responses that agree on dtype, op and scale factors are fused:
small tensors are packed into one reusable buffer (one transfer), while tensors of at least
``AIAK_ZERO_COPY_BYTES`` are reduced in place, since copying them in and out would cost more
than the extra call saves.
"""
from typing import Callable, List

import numpy as np

from aiak_training.common import native
from aiak_training.common.config import Config
from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp
from aiak_training.common.messages import CONTROL_OPS, OpType, Response
from aiak_training.runtime.entries import SetState, TensorEntry
from aiak_training.runtime.execute.completion import Completer
from aiak_training.runtime.execute.host_collectives import HostCollectives
from aiak_training.runtime.execute.layouts import average_postscale, prod


class Executor:
    """Runs a batch of responses on this rank, in the agreed order.

    ``control(state, response)`` carries out process-set changes, which belong to the engine;
    ``join_device()`` is the CUDA device named by ``hvd.join`` (-1 if none), where a joined
    rank's zeros go.  The GPU executor is made when the first GPU response arrives, with the
    same host collectives for its staged path.
    """

    def __init__(self, config: Config, completer: Completer,
                 control: Callable[[SetState, Response], None],
                 join_device: Callable[[], int]):
        self.config = config
        self.completer = completer
        self.control = control
        self.join_device = join_device
        self.host = HostCollectives(config, completer)
        self._zeros_keep: List[np.ndarray] = []
        self._gpu_executor = None

    def _gpu(self):
        """The GPU executor, made on the first GPU response (CPU-only jobs never load CUDA)."""
        if self._gpu_executor is None:
            from aiak_training.runtime.execute.gpu_executor import GpuExecutor
            self._gpu_executor = GpuExecutor(self.host, self.completer, self.config,
                                             self.join_device)
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
    def gpu_allreduce(self, state: SetState, payload: tuple) -> int:
        """Run a fused allreduce of CUDA tensors (the C++ thread fused it, and passes it as
        csrc/engine's GpuAllreduce tuple); returns its completion event."""
        from aiak_training.runtime.execute.gpu_executor import FusedAllreduce
        return self._gpu().allreduce(state, FusedAllreduce(*payload))

    def execute(self, state: SetState, responses: List[Response]) -> None:
        """Run responses other than CUDA allreduces (see :meth:`gpu_allreduce`)."""
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
                self._allreduce(state, group)
                i = j
                continue
            if resp.gpu:
                self._gpu().single(state, resp)
            else:
                e = self._entry(state, resp)
                done.finish(state, [resp], result=self.host.run_single(state, resp, e))
            i += 1
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
            if e.in_addr != e.out_addr and e.count:
                native.copy_batch([e.out_addr], [e.in_addr], [e.nbytes])
            self.host.reduce_host(state, [e.name], e.out_addr, e.count, dtype, op, pre, post)
            # Complete each large tensor as soon as it lands, not with the whole response:
            # an overlapped optimizer can update it while the rest are still on the wire.
            self.completer.finish(state, [r])
        if packed:
            self._allreduce_fused(state, [e for _, e in packed], dtype, op, pre, post)
            self.completer.finish(state, [r for r, _ in packed])

    def _allreduce_fused(self, state, entries, dtype, op, pre, post) -> None:
        itemsize = ITEMSIZE[dtype]
        total = sum(e.nbytes for e in entries)
        base = self.host.fusion_buffer(total)
        offsets, off = [], 0
        for e in entries:
            offsets.append(base + off)
            off += e.nbytes
        names = [e.name for e in entries]
        activity = self.completer.activity
        activity(names, "MEMCPY_IN_FUSION_BUFFER")
        native.copy_batch(offsets, [e.in_addr for e in entries], [e.nbytes for e in entries])
        activity(names, None)
        native.scale(base, total // itemsize, int(dtype), pre)
        activity(names, "MPI_ALLREDUCE")
        self.host.reduce(state, base, [e.count for e in entries], dtype, op)
        activity(names, None)
        activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        outs = [e.out_addr for e in entries]
        if post != 1.0:
            native.copy_scaled_batch(outs, offsets, [e.count for e in entries], int(dtype), post)
        else:
            native.copy_batch(outs, offsets, [e.nbytes for e in entries])
        activity(names, None)
