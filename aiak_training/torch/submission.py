"""Handing torch tensors to the engine, and the handles that come back.

Every collective of ``mpi_ops`` ends here: :func:`_submit` turns (input, output) pairs into
the engine's requests and returns one user handle; :func:`_submit_host_allreduce` and
:func:`_submit_allreduces` are the allreduce's faster routes, which build no request
objects.  ``_handle_map`` remembers, per user handle, how to wait and what to return, which
is what :func:`synchronize` runs; :func:`poll` asks without waiting.  The checks every
collective makes on its tensors and ``op`` are here too.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from aiak_training.common.dtypes import DataType, ReduceOp
from aiak_training.common.horovod_strings import TENSOR_TYPE_NOT_SUPPORTED
from aiak_training.common.messages import OpType, Request
from aiak_training.runtime import basics as _basics
from aiak_training.runtime import current
from aiak_training.runtime.arrays import array_ops
from aiak_training.runtime.entries import TensorEntry, unknown_handle
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.torch import cuda as _cuda
from aiak_training.torch import output_pool

_DTYPES = {
    torch.uint8: DataType.UINT8, torch.int8: DataType.INT8, torch.int16: DataType.INT16,
    torch.int32: DataType.INT32, torch.int64: DataType.INT64, torch.float16: DataType.FLOAT16,
    torch.bfloat16: DataType.BFLOAT16, torch.float32: DataType.FLOAT32,
    torch.float64: DataType.FLOAT64, torch.bool: DataType.BOOL,
}

# handle -> function turning the engine's result into the user's return value
_handle_map: Dict[int, Callable[[Any], Any]] = {}
# user handle of a CUDA operation -> all its engine handles (poll also asks the device)
_gpu_handles: Dict[int, List[int]] = {}


# ---- helpers ------------------------------------------------------------------------------
def _dtype(tensor: torch.Tensor) -> DataType:
    dt = _DTYPES.get(tensor.dtype)
    if dt is None:
        raise ValueError(TENSOR_TYPE_NOT_SUPPORTED.format(tensor.dtype))
    return dt


def _check_tensor(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"Expected a torch.Tensor, got {type(tensor).__name__}.")
    if not (tensor.is_cpu or tensor.is_cuda):
        raise ValueError(f"Tensor device {tensor.device} is not supported: aiak_training "
                         "works on CPU and CUDA tensors.")
    if tensor.is_sparse:
        raise ValueError("Sparse tensors are not supported by this op; use "
                         "sparse_allreduce_async or sparse_as_dense=True.")


_REDUCE_OPS = {int(rop): rop for rop in ReduceOp}


def _check_op(op: int, tensor: torch.Tensor) -> ReduceOp:
    try:
        rop = _REDUCE_OPS[op]  # what ReduceOp(op) accepts, by one dict lookup
    except (KeyError, TypeError):
        raise ValueError(f"Unknown reduce op {op!r}.") from None
    if rop == ReduceOp.ADASUM:
        array_ops.check_adasum_dtype(_dtype(tensor), tensor.dtype)
        if tensor.is_cuda:
            raise NotImplementedError("Adasum runs on CPU tensors only in aiak_training; move "
                                      "the tensor to the CPU (tensor.cpu()) to reduce it.")
    if tensor.dtype == torch.bool and rop == ReduceOp.AVERAGE:
        raise ValueError("Average is not supported for bool tensors; use Sum/Max (logical or) "
                         "or Min/Product (logical and).")
    return rop


def _name(prefix: str, name: Optional[str]) -> array_ops.Names:
    """Names of a single-tensor op: ``<prefix>.<name>``, or generated (see ``Names``)."""
    return array_ops.Names(prefix, f"{prefix}.{name}" if name else None)


def _submit(op_type: OpType, pairs: List[Tuple[torch.Tensor, Optional[torch.Tensor]]],
            names: array_ops.Names, process_set: ProcessSet, finish: Callable[[List[Any]], Any],
            allocate: Optional[Callable[[int], Callable]] = None, **fields) -> int:
    """Enqueue one request per (input, output) pair; return a single user handle."""
    if not pairs:
        raise ValueError("Expected at least one tensor.")
    engine = current.engine()
    set_rank = array_ops.set_rank(process_set, engine)
    dtypes = [_dtype(inp) for inp, _ in pairs]  # all valid before a name is taken
    on_gpu = _on_gpu([inp for inp, _ in pairs])
    names = names.resolve(len(pairs), process_set.process_set_id)
    requests, entries = [], []
    device, stream, event = -1, None, 0
    if on_gpu:  # one device, one producer stream and one ready event for the whole call
        device, stream, event = _cuda.ready([inp for inp, _ in pairs])
    cuda_stream = int(stream.cuda_stream) if on_gpu else 0
    for i, ((inp, out), name, dt) in enumerate(zip(pairs, names, dtypes)):
        shape = tuple(inp.shape)
        # Positional arguments: this runs once per tensor per step.
        requests.append(Request(set_rank, name, op_type, int(dt), shape, device=device,
                                **fields))
        entries.append(TensorEntry(name, dt, shape, inp.data_ptr(),
                                   out.data_ptr() if out is not None else 0,
                                   allocate(i, stream) if allocate else None,
                                   (inp, out), device, cuda_stream, event))
    handles = engine.enqueue(process_set.process_set_id, requests, entries)
    user_handle = handles[0]

    def complete():
        done = [engine.wait(h) for h in handles]
        if on_gpu:
            # The engine's stream may still be working: the consumer's stream waits for it.
            # Until then the inputs stay referenced here, so their memory is not reused.
            _cuda.consume(device, [h.event for h in done], stream)
            del pairs[:]
        return finish([h.result for h in done])
    _handle_map[user_handle] = complete
    if on_gpu:
        _gpu_handles[user_handle] = handles
    return user_handle


def _on_gpu(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors of one call are CUDA tensors; a clear error if they mix devices."""
    on_gpu = tensors[0].is_cuda
    if len(tensors) > 1:
        other = next((t for t in tensors if t.is_cuda != on_gpu), None)
        if other is not None:
            raise ValueError(f"A grouped operation takes tensors on one device: got "
                             f"{tensors[0].device} and {other.device} tensors mixed in one "
                             "call. Move them to one device first.")
    return on_gpu


def _contiguous_inplace(tensor: torch.Tensor) -> Tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous working copy for in-place ops on non-contiguous tensors, and a copy-back."""
    if tensor.is_contiguous():
        return tensor, lambda: None
    work = tensor.contiguous()
    return work, lambda: tensor.copy_(work)


def _submit_host_allreduce(src: torch.Tensor, out: torch.Tensor, names: array_ops.Names,
                           rop: ReduceOp, prescale_factor: float, postscale_factor: float,
                           process_set: ProcessSet, finish) -> int:
    """One CPU tensor: the per-tensor hot path (no Request/TensorEntry objects built)."""
    engine = current.engine()
    set_id = process_set.process_set_id
    set_rank = engine.rank_in_set(set_id)
    if set_rank is None:
        set_rank = array_ops.set_rank(process_set, engine)  # raises the right error
    dt = _dtype(src)
    (name,) = names.resolve(1, set_id)
    handle = engine.submit_allreduce(set_id, set_rank, name, int(dt), tuple(src.shape),
                                     src.data_ptr(), out.data_ptr(), int(rop),
                                     float(prescale_factor), float(postscale_factor), (src, out))
    wait = engine.wait_result
    _handle_map[handle] = lambda: finish([wait(handle)])
    return handle


def _submit_allreduces(srcs: List[torch.Tensor], outs: List[torch.Tensor],
                       names: array_ops.Names, rop: ReduceOp, prescale_factor: float,
                       postscale_factor: float, process_set: ProcessSet, finish) -> int:
    """The allreduces of one call other than a lone CPU tensor: one list per field to the
    engine and no Request/TensorEntry objects; for CUDA tensors one ready event for the call,
    and one wait for all its handles at synchronize."""
    engine = current.engine()
    set_id = process_set.process_set_id
    set_rank = engine.rank_in_set(set_id)
    if set_rank is None:
        set_rank = array_ops.set_rank(process_set, engine)  # raises the right error
    dtypes = [int(_dtype(t)) for t in srcs]  # all valid before a name is taken
    on_gpu = _on_gpu(srcs)
    shapes = [tuple(t.shape) for t in srcs]
    ins = [t.data_ptr() for t in srcs]
    outputs = [t.data_ptr() for t in outs]
    names = names.resolve(len(srcs), set_id)
    pre, post = float(prescale_factor), float(postscale_factor)
    if not on_gpu:
        handles = engine.submit_allreduces(set_id, set_rank, names, dtypes, shapes, ins,
                                           outputs, int(rop), pre, post, (srcs, outs))
        wait_all = engine.wait_all
        _handle_map[handles[0]] = lambda: finish(wait_all(handles)[0])
        return handles[0]
    # One device, one producer stream and one ready event for the whole call.
    device, stream, event = _cuda.ready(srcs)
    held = [srcs, outs]
    try:
        handles = engine.submit_allreduces(set_id, set_rank, names, dtypes, shapes, ins,
                                           outputs, int(rop), pre, post, held, device, event)
    except BaseException:
        _cuda.give_back(event, len(srcs))
        raise

    def complete():
        results, events = engine.wait_all(handles)
        # The engine's stream may still be working: the consumer's stream waits for it.
        # Until then the inputs stay referenced here, so their memory is not reused.
        _cuda.consume(device, events, stream)
        held.clear()
        return finish(results)
    _handle_map[handles[0]] = complete
    _gpu_handles[handles[0]] = handles
    return handles[0]


# ---- outputs the engine sizes --------------------------------------------------------------
def _allocator(outputs: List[Optional[torch.Tensor]], like: List[torch.Tensor]):
    """Allocators for outputs whose shape the engine learns in negotiation; ``stream`` is the
    submitting stream of a CUDA tensor (None on the CPU)."""
    def make(i: int, stream=None):
        def allocate(shape):
            if stream is None:
                outputs[i] = output_pool.pool.empty(shape, like[i].dtype)
            else:
                outputs[i] = _cuda.empty_on_stream(shape, like[i].dtype, stream)
            return outputs[i].data_ptr()
        return allocate
    return make


def _into(out: torch.Tensor) -> Callable[..., Callable[[Tuple[int, ...]], int]]:
    """The ``allocate`` factory of :func:`_submit` for an ``out=`` tensor: every result
    lands in ``out``, which must be large enough."""
    def make(_index: int, _stream=None) -> Callable[[Tuple[int, ...]], int]:
        def allocate(shape: Tuple[int, ...]) -> int:
            numel = 1
            for d in shape:
                numel *= int(d)
            if numel > out.numel():  # another rank passed a larger tensor: never overrun
                raise RuntimeError(f"a collective result of {numel} elements does not fit "
                                   f"its {out.numel()}-element out= tensor; the ranks "
                                   "disagree on the shapes.")
            return out.data_ptr()
        return allocate
    return make


def _allgather_into(src: torch.Tensor, out: torch.Tensor, names: array_ops.Names,
                    process_set: ProcessSet) -> int:
    """``allgather_async(out=)``: the equal-sized flat ``src`` of every rank gathered into
    the first ``size * src.numel()`` elements of ``out`` (``synchronize`` returns that view;
    ``src`` may be this rank's block of ``out``).  Nothing comes from the output pool."""
    _check_tensor(src)
    n = process_set.size() if process_set.process_set_id else _basics.size()
    return _submit(OpType.ALLGATHER, [(src, out)], names, process_set,
                   lambda _: out[:n * src.numel()], allocate=_into(out))


def _reducescatter_into(src: torch.Tensor, out: torch.Tensor, names: array_ops.Names, op: int,
                        prescale: float, postscale: float, process_set: ProcessSet) -> int:
    """``reducescatter_async(out=)``: this rank's block of the reduced flat ``src`` written
    into ``out`` (``synchronize`` returns ``out``).  Nothing comes from the output pool."""
    array_ops.refuse_adasum_reducescatter(op)
    _check_tensor(src)
    rop = _check_op(op, src)
    return _submit(OpType.REDUCESCATTER, [(src, out)], names, process_set, lambda _: out,
                   allocate=_into(out), reduce_op=int(rop), prescale=float(prescale),
                   postscale=float(postscale))


# ---- waiting ------------------------------------------------------------------------------
def poll(handle: int) -> bool:
    """True once the operation behind ``handle`` is done (for CUDA tensors, on the device
    too), so that :func:`synchronize` will not block."""
    engine = current.engine()
    if handle not in _gpu_handles:
        return engine.poll(handle)
    # Every tensor of the op is enqueued, and the device has finished all of them.
    handles = _gpu_handles[handle]
    return all(engine.poll(h) for h in handles) and \
        all(_cuda.event_done(e) for e in {engine.handle_event(h) for h in handles})


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its result: a tensor, or a tuple
    for grouped operations and alltoall.  A handle can be synchronized once: after that, or
    for a handle this process never issued, it raises ``ValueError``, as :func:`poll` does."""
    finish = _handle_map.pop(handle, None)
    _gpu_handles.pop(handle, None)
    if finish is None:
        raise unknown_handle(handle)
    return finish()


# ---- control ------------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """Say that this rank has no more data, and wait until every rank has said so.

    Meanwhile the collectives the other ranks still issue go ahead, with this rank taking
    part with zeros.  ``device`` is the GPU those zeros are made on; -1 picks the GPU this
    rank used last, or the CPU.  Returns the rank that joined last.
    """
    if device is None or device < 0:
        device = _cuda.used_device()
    if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()  # a rank that joins before any GPU op
    if device is not None and device >= 0:
        # Zeros for GPU collectives that run while this rank has joined go on this device.
        current.engine().join_device = int(device)
    return int(current.engine().run_control(0, OpType.JOIN, "join"))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every member of ``process_set`` (all ranks by default) has called
    barrier."""
    engine = current.engine()
    array_ops.set_rank(process_set, engine)  # raises for a set this rank is not in
    engine.run_control(process_set.process_set_id, OpType.BARRIER, "barrier")
