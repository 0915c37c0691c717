"""Executing negotiated responses whose tensors live in GPU memory.

Runs on the engine thread, called by :class:`aiak_training.runtime.execute.executor.Executor`
for responses with ``gpu=True``.  Allreduces come already fused by the C++ thread, as one
:class:`FusedAllreduce` of lists (it holds their entries and completes them with the event
returned here); the other collectives come as responses.  Everything is enqueued on one
engine stream per device, which first waits for the tensors' ``ready_event`` (recorded on
the producer's stream when they were submitted: one event per call, shared by its tensors,
so one wait per call).  A response
completes as soon as its work is enqueued: one completion event is recorded for all its
tensors, and the frontend makes the consumer's stream wait on it.  Shared events are counted
(``Runtime.record``'s ``uses``), so the pool takes one back only from its last holder.  The
host never waits for the device on this path (the MPI fallback does, by design).

Transports, agreed by all ranks of a process set on its first GPU response:

* **nccl**: collectives on the device.  Small allreduce tensors are packed into a device
  fusion buffer (one batched-copy kernel launch, or ``cudaMemcpyAsync`` per tensor without
  the kernel library); tensors of at least
  ``AIAK_ZERO_COPY_BYTES`` are reduced straight from input to output.  The allreduces of one
  response (the direct ones and the fusion buffer's) are one NCCL group.  Scale factors are
  folded into the NCCL reduction (ncclAvg or a pre-multiplied sum;
  :func:`nccl.plan_reduction` lists where that rounds differently from Horovod); what NCCL
  cannot express (int16, Min/Max/Product with scale factors, fractional factors on
  integers) takes the MPI path for that response.
  With the hierarchical algorithm on a homogeneous multi-node cluster, allreduce uses
  :mod:`aiak_training.allreduce.hier_nccl`.
* **mpi**: staged through pinned host buffers and the CPU engine's own code (including its
  allreduce algorithm).  Used when asked for (``AIAK_GPU_TRANSPORT=mpi`` or
  ``HOROVOD_GPU_OPERATIONS=MPI``), when NCCL is not installed, or when ranks share a GPU,
  which NCCL refuses.

This module holds the executor and its resources (streams, buffers, the joined ranks'
zeros); the transport agreement and the NCCL calls are in ``gpu_nccl.py``, the staging and
fusion-buffer copies in ``gpu_buffers.py``.
"""
import logging
from collections import Counter
from typing import Callable, Dict, List, Tuple

from aiak_training.common.config import Config
from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp
from aiak_training.common.gpu import kernels, nccl
from aiak_training.common.gpu.cudart import runtime
from aiak_training.common.messages import OpType, Response
from aiak_training.runtime.entries import SetState, TensorEntry
from aiak_training.runtime.execute.completion import Completer
from aiak_training.runtime.execute.gpu_buffers import (FUSION_ALIGN, HostBuffer, StagedEntry,
                                                       copy_buffers, pack, packed_offsets,
                                                       unpack)
from aiak_training.runtime.execute.gpu_nccl import (UNSUPPORTED, SetContext, agree_transport,
                                                    check_async_errors, flat_allreduce,
                                                    hier_allreduce, hierarchical, nccl_single)
from aiak_training.runtime.execute.host_collectives import HostCollectives
from aiak_training.runtime.execute.layouts import average_postscale

log = logging.getLogger("aiak_training")


class FusedAllreduce:
    """A fused allreduce of CUDA tensors as the C++ thread hands it to the lane
    (csrc/engine/engine.h, ``GpuAllreduce``): one list per field, built once per response
    rather than an object per tensor.  Tensor ``i`` of this rank reads ``ins[i]`` and writes
    ``outs[i]``, after its producer's ``ready_events[i]``; indices in ``missing`` are tensors
    of ranks that joined, where this rank contributes ``counts[i]`` zeros."""
    __slots__ = ("names", "dtype", "reduce_op", "prescale", "postscale", "device", "ins",
                 "outs", "counts", "ready_events", "missing")

    def __init__(self, names: List[str], dtype: int, reduce_op: int, prescale: float,
                 postscale: float, device: int, ins: List[int], outs: List[int],
                 counts: List[int], ready_events: List[int], missing: List[int]):
        self.names, self.dtype, self.reduce_op = names, dtype, reduce_op
        self.prescale, self.postscale = prescale, postscale
        self.device, self.ins, self.outs, self.counts = device, ins, outs, counts
        self.ready_events, self.missing = ready_events, missing


class GpuExecutor:
    def __init__(self, host: HostCollectives, completer: Completer, config: Config,
                 join_device: Callable[[], int]):
        """``host`` runs the staged path's transfers on pinned host copies; ``join_device()``
        is the CUDA device ``hvd.join`` named (-1 if none), where a joined rank's zeros go."""
        self.host = host
        self.completer = completer
        self.config = config
        self.join_device = join_device
        self.rt = runtime()
        self._streams: Dict[Tuple[int, int], int] = {}
        self._sets: Dict[int, SetContext] = {}
        self._fusion: Dict[int, Tuple[int, int]] = {}   # device -> (address, bytes)
        self._stage_in = HostBuffer(self.rt)
        self._stage_out = HostBuffer(self.rt)
        self._device = -1                                # this rank's device, once seen
        # One launch per 64 tensors for the fusion buffer, where setup.py built the kernels.
        self._batched = kernels.library() is not None
        if not self._batched:
            log.info("GPU fusion buffer: one cudaMemcpyAsync per tensor (%s)", kernels.error())
        self._scratch: List[int] = []                    # device memory for joined ranks

    # ---- resources ---------------------------------------------------------------------
    def _stream(self, device: int, which: int = 0) -> int:
        key = (device, which)
        if key not in self._streams:
            self._streams[key] = self.rt.stream_create()
        return self._streams[key]

    def _fusion_buffer(self, device: int, nbytes: int) -> int:
        addr, size = self._fusion.get(device, (0, 0))
        if size < nbytes:
            # cudaFree waits for the device, so the old buffer is idle when it goes.
            self.rt.free(addr)
            size = max(nbytes, 2 * size)
            addr = self.rt.malloc(size)
            self._fusion[device] = (addr, size)
        return addr

    def _context(self, state: SetState) -> SetContext:
        """The set's transport, agreed by all its ranks (collective on first use).  Raises
        if NCCL reported an asynchronous error (a peer failed): the engine then stops and
        aborts the communicators, which releases kernels waiting for that peer."""
        ctx = self._sets.get(state.id)
        if ctx is not None:
            check_async_errors(ctx)
            return ctx
        ctx = agree_transport(state, self.config, self.rt, self._current_device())
        self._sets[state.id] = ctx
        return ctx

    def _current_device(self) -> int:
        """This rank's device: from its tensors, else the one hvd.join() named."""
        if self._device >= 0:
            return self._device
        join_device = self.join_device()
        if join_device >= 0:
            return join_device
        return self.rt.get_device()

    # ---- entries -----------------------------------------------------------------------
    def _entries(self, state: SetState, responses: List[Response],
                 stream_for) -> List[TensorEntry]:
        """This rank's entries (device zeros where it joined), and the device in use.  The
        engine stream waits for each tensor's producer."""
        found = [state.entries.get(r.names[0]) for r in responses]
        for e in found:
            if e is not None:
                self._device = e.device
                break
        device = self._current_device()
        self.rt.set_device(device)
        stream = stream_for(device)
        entries = []
        waited = set()  # the tensors of one call share one ready event: one wait for them
        for r, e in zip(responses, found):
            if e is None:  # this rank joined: it contributes zeros
                dtype = DataType(r.dtype)
                shape = r.shapes[0][state.rank]
                count = 1
                for d in shape:
                    count *= d
                nbytes = count * ITEMSIZE[dtype]
                addr = self._zeros(nbytes, stream)
                e = TensorEntry(r.names[0], dtype, shape, addr, addr, device=device,
                                stream=-1, allocate=lambda _shape, a=addr + nbytes: a)
            elif e.ready_event:
                event = e.ready_event
                if event not in waited:
                    self.rt.wait_event(stream, event)
                    waited.add(event)
                self.rt.event_put(event)  # one use per entry (Runtime.record's ``uses``)
                e.ready_event = 0
            entries.append(e)
        return entries

    def _zeros(self, nbytes: int, stream: int) -> int:
        """Device memory holding ``nbytes`` zeros, with room after them for an output of
        twice that (a joined rank's stand-in tensor), freed by :meth:`_free_scratch`."""
        addr = self.rt.malloc(2 * nbytes + 64)
        self._scratch.append(addr)
        self.rt.memset_async(addr, 0, nbytes, stream)
        return addr

    def _free_scratch(self, stream: int) -> None:
        if self._scratch:  # joined-rank zeros: rare; wait, then free
            self.rt.stream_synchronize(stream)
            for addr in self._scratch:
                self.rt.free(addr)
            self._scratch.clear()

    def _allocate(self, e: TensorEntry, shape, stream: int) -> int:
        """The output of an allgather/alltoall/reducescatter, allocated by the frontend on the
        submitting stream; ours waits for what that stream did with the memory before."""
        addr = e.allocate(shape)
        if e.stream >= 0:  # 0 is the legacy default stream; stand-ins carry -1
            event = self.rt.record(e.stream)
            self.rt.wait_event(stream, event)
            self.rt.event_put(event)
        return addr

    def _complete(self, state: SetState, responses: List[Response], stream: int,
                  result=None) -> None:
        # One completion event for the whole fused response, with one use per local tensor
        # (the frontend gives each back): one record, not one per tensor.
        local = [r.names[0] for r in responses if r.names[0] in state.entries]
        events = dict.fromkeys(local, self.rt.record(stream, uses=len(local))) if local \
            else None
        self.completer.finish(state, responses, result=result, events=events)
        self._free_scratch(stream)

    # ---- allreduce ---------------------------------------------------------------------
    def allreduce(self, state: SetState, call: FusedAllreduce) -> int:
        """Enqueue a fused allreduce on the engine stream; return its completion event, with
        one use per tensor of this rank (0 if it has none: it joined).  The C++ thread
        completes the tensors with it."""
        dtype, op = DataType(call.dtype), ReduceOp(call.reduce_op)
        if call.device >= 0:
            self._device = call.device
        device = self._current_device()
        self.rt.set_device(device)
        stream = self._stream(device)
        self._wait_ready(stream, call.ready_events)
        item = ITEMSIZE[dtype]
        for i in call.missing:  # this rank joined: it contributes zeros
            call.ins[i] = call.outs[i] = self._zeros(call.counts[i] * item, stream)
        ctx = self._context(state)
        plan = None
        if ctx.transport == "nccl":
            plan = nccl.plan_reduction(dtype, op, call.prescale, call.postscale, state.size,
                                       ctx.nccl_version)
        nbytes = [c * item for c in call.counts]
        if plan is None:  # the CPU code it runs marks MPI_ALLREDUCE on the timeline
            self._staged_allreduce(state, call, nbytes, dtype, op, call.prescale,
                                   average_postscale(call, state.size), stream)
        else:  # the timeline shows the enqueueing; the device runs it later
            self.completer.activity(call.names, "NCCL_ALLREDUCE")
            self._nccl_allreduce(ctx, call, nbytes, dtype, plan, stream)
            self.completer.activity(call.names, None)
        local = len(call.names) - len(call.missing)
        event = self.rt.record(stream, uses=local) if local else 0
        self._free_scratch(stream)
        return event

    def _wait_ready(self, stream: int, ready_events: List[int]) -> None:
        """The engine stream waits once for each producer event (the tensors of one call
        share one), and gives back the uses its tensors held."""
        for event, uses in Counter(ready_events).items():
            if event:
                self.rt.wait_event(stream, event)
                self.rt.event_put(event, uses)

    def _nccl_allreduce(self, ctx: SetContext, call: FusedAllreduce, nbytes: List[int],
                        dtype: DataType, plan, stream: int) -> None:
        ins, outs, counts = call.ins, call.outs, call.counts
        zero_copy = ctx.zero_copy_bytes
        packed = [i for i, n in enumerate(nbytes) if n < zero_copy]
        if len(packed) > 1:
            direct = [i for i, n in enumerate(nbytes) if n >= zero_copy]
        else:  # a lone small tensor gains nothing from the fusion buffer
            packed, direct = [], range(len(nbytes))
        # (send, recv, count) of each NCCL allreduce this response makes.
        calls = [(ins[i], outs[i], counts[i]) for i in direct if counts[i]]
        if packed:
            # 16-byte slots keep the copy kernel on its vector path; the few padding elements
            # are reduced along (16 is a multiple of every element size) and never read.
            sizes = [nbytes[i] for i in packed]
            offsets = packed_offsets(0, sizes, FUSION_ALIGN)
            total = offsets[-1] + sizes[-1]
            base = self._fusion_buffer(ctx.device, total)
            offsets = [base + off for off in offsets]
            self._device_copy(offsets, [ins[i] for i in packed], sizes, stream)
            if total:
                calls.append((base, base, total // ITEMSIZE[dtype]))
        if hierarchical(ctx, plan[0], dtype):
            for send, recv, count in calls:
                self._hier_allreduce(ctx, send, recv, count, dtype, plan, stream)
        elif calls:
            flat_allreduce(ctx, calls, dtype, plan, stream)
        if packed:
            self._device_copy([outs[i] for i in packed], offsets, sizes, stream)

    def _device_copy(self, dsts, srcs, sizes, stream: int) -> None:
        """Device-to-device copies: the batched kernel, or cudaMemcpyAsync per buffer if the
        kernel cannot run here (e.g. built for newer GPUs than this one): then once, with a
        warning, and never again in this process."""
        if self._batched:
            try:
                kernels.batched_copy(dsts, srcs, sizes, stream)
                return
            except kernels.KernelError as exc:
                self._batched = False
                log.warning("the batched-copy kernel failed (%s); the GPU fusion buffer uses "
                            "one cudaMemcpyAsync per tensor from now on", exc)
        copy_buffers(self.rt, dsts, srcs, sizes, stream, False)

    def _hier_allreduce(self, ctx: SetContext, send: int, recv: int, count: int,
                        dtype: DataType, plan, stream: int) -> None:
        cross_stream = self._stream(ctx.device, 1) if ctx.overlap else stream
        hier_allreduce(self.rt, ctx, send, recv, count, dtype, plan, stream, cross_stream)

    def _staged_allreduce(self, state, call: FusedAllreduce, sizes: List[int], dtype, op, pre,
                          post, stream) -> None:
        names = call.names
        if not (self._batched and len(sizes) > 1):
            host = self._stage_in.get(sum(sizes))
            offsets = pack(self.rt, host, call.ins, sizes, stream)
            self.rt.stream_synchronize(stream)
            self.host.reduce_host(state, names, host, sum(sizes) // ITEMSIZE[dtype], dtype, op,
                                  pre, post)
            unpack(self.rt, call.outs, offsets, sizes, stream)
            self._stage_in.release_after(stream)
            return
        # Gathered in the device fusion buffer first (one kernel launch per 64 tensors), then
        # one copy each way: two DMA transfers instead of two per tensor.  The padding between
        # slots is reduced along and never read, as on the NCCL path.
        offsets = packed_offsets(0, sizes, FUSION_ALIGN)
        total = offsets[-1] + sizes[-1]
        base = self._fusion_buffer(self._current_device(), total)
        slots = [base + off for off in offsets]
        self._device_copy(slots, call.ins, sizes, stream)
        host = self._stage_in.get(total)
        self.rt.memcpy_async(host, base, total, stream)
        self.rt.stream_synchronize(stream)
        self.host.reduce_host(state, names, host, total // ITEMSIZE[dtype], dtype, op, pre, post)
        self.rt.memcpy_async(base, host, total, stream)
        self._device_copy(call.outs, slots, sizes, stream)
        self._stage_in.release_after(stream)

    # ---- allgather / broadcast / alltoall / reducescatter ------------------------------
    def single(self, state: SetState, resp: Response) -> None:
        (e,) = self._entries(state, [resp], self._stream)
        ctx = self._context(state)
        stream = self._stream(ctx.device)
        result = UNSUPPORTED
        if ctx.transport == "nccl":
            self.completer.activity(resp, "NCCL_" + resp.op_type.name)
            result = nccl_single(ctx, state, resp, e, stream, self._allocate)
            self.completer.activity(resp, None)
        if result is UNSUPPORTED:  # the CPU code marks MPI_<OP> on the timeline
            result = self._staged_single(state, resp, e, stream)
        self._complete(state, [resp], stream, result=result)

    def _staged_single(self, state, resp: Response, e, stream: int):
        """Copy the input to pinned memory, run the host collective on it, copy the
        output back to the device."""
        host_in = self._stage_in.get(e.nbytes)
        self.rt.memcpy_async(host_in, e.in_addr, e.nbytes, stream)
        self.rt.stream_synchronize(stream)
        staged_out: List[tuple] = []

        def allocate(shape):
            n = 1
            for d in shape:
                n *= d
            addr = self._stage_out.get(n * ITEMSIZE[e.dtype])
            staged_out.append((shape, addr, n * ITEMSIZE[e.dtype]))
            return addr
        proxy = StagedEntry(e, host_in, host_in, allocate)
        result = self.host.run_single(state, resp, proxy)
        if resp.op_type == OpType.BROADCAST:
            self.rt.memcpy_async(e.out_addr, host_in, e.nbytes, stream)
        else:
            shape, addr, nbytes = staged_out[0]
            out = self._allocate(e, shape, stream)
            self.rt.memcpy_async(out, addr, nbytes, stream)
            self._stage_out.release_after(stream)
        self._stage_in.release_after(stream)
        return result

    # ---- teardown ----------------------------------------------------------------------
    def forget_set(self, set_id: int) -> None:
        ctx = self._sets.pop(set_id, None)
        if ctx is not None:
            for stream in self._streams.values():
                self.rt.stream_synchronize(stream)
            for comm in ctx.comms.values():
                comm.destroy()

    def close(self, clean: bool) -> None:
        """Destroy the communicators after the streams drain, or abort them (``clean`` False:
        a peer may be gone, and NCCL kernels waiting for it would never finish)."""
        if clean:
            try:
                for stream in self._streams.values():
                    self.rt.stream_synchronize(stream)
            except RuntimeError as exc:
                log.warning("draining the GPU streams at shutdown: %s", exc)
                clean = False
        for ctx in self._sets.values():
            for comm in ctx.comms.values():
                try:
                    comm.destroy() if clean else comm.abort()
                except (nccl.NcclError, RuntimeError) as exc:
                    log.warning("releasing an NCCL communicator: %s", exc)
                    clean = False
        self._sets.clear()
        if clean:
            self._stage_in.free()
            self._stage_out.free()
            for addr, _ in self._fusion.values():
                self.rt.free(addr)
            self._fusion.clear()

