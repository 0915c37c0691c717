"""Collective operations on torch tensors (the ``horovod.torch.mpi_ops`` API).

Thin adapters: a tensor becomes (address, dtype, shape) for the engine, and the engine's
completion becomes a tensor again.  No framework C++ is involved.

What holds for every collective below, so that each docstring can stay short:

* ``name`` is how the ranks recognise one operation: every member of ``process_set`` (the
  global set unless given) submits it under the same name and dtype.  Left out, a name is
  drawn from a per-set counter, so unnamed calls must come in the same order on all ranks.
  Nothing moves before every member has submitted.
* ``*_async`` calls return an integer handle: :func:`synchronize` waits and returns the
  result, :func:`poll` says whether that would block.
* A trailing ``_`` means in place: the result is written into the argument, which is also
  returned.  The others never touch their argument and return fresh tensors.
* The blocking out-of-place calls are differentiable (each says what its gradient is).
* ``op`` is Average (the default when None), Sum, Adasum, Min, Max or Product (Adasum:
  allreduce only; float tensors on CPU; the global set, of a power-of-two size).
  ``average`` is the deprecated older switch (True: Average, False: Sum); give one of the
  two, not both.
  ``prescale_factor`` and ``postscale_factor`` multiply the data before and after reducing.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch

from aiak_training.runtime import basics as _basics
from aiak_training.runtime import current
from aiak_training.runtime.basics import (add_process_set, ccl_built, cross_rank, cross_size,  # noqa: F401
                                         cuda_built, ddl_built, gloo_built, gloo_enabled,
                                         is_homogeneous, is_initialized, local_rank,
                                         local_size, mpi_built, mpi_enabled,
                                         mpi_threads_supported, nccl_built, rank,
                                         remove_process_set, rocm_built, shutdown, size,
                                         start_timeline, stop_timeline)
from aiak_training.common.dtypes import (Adasum, Average, DataType, Max, Min,  # noqa: F401
                                         Product, ReduceOp, Sum,
                                         handle_average_backwards_compatibility)
from aiak_training.common.horovod_strings import TENSOR_TYPE_NOT_SUPPORTED
from aiak_training.runtime import array_ops
from aiak_training.runtime.entries import TensorEntry, unknown_handle
from aiak_training.common.exceptions import HorovodInternalError  # noqa: F401
from aiak_training.common.messages import OpType, Request
from aiak_training.runtime.process_sets import ProcessSet, global_process_set
from aiak_training.torch.compression import Compression, Compressor
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


def init(comm=None, process_sets=None) -> None:
    if _basics.is_initialized():
        return
    _basics.init(comm, process_sets)
    _handle_map.clear()
    array_ops.reset_names()


init.__doc__ = _basics.init.__doc__


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



# ---- autograd -----------------------------------------------------------------------------
# The blocking out-of-place collectives run through these Functions.  Each backward calls the
# public collectives, themselves differentiable, so double backward works.  The gradient
# formulas are Horovod's: models trained with it must get the same updates here.
_ReduceOptions = Dict[str, Any]


def _reduce_options(average: Optional[bool], op: Optional[int], prescale_factor: float,
                    postscale_factor: float, process_set: ProcessSet) -> _ReduceOptions:
    return {"average": average, "op": op, "prescale_factor": prescale_factor,
            "postscale_factor": postscale_factor, "process_set": process_set}


class _Allreduce(torch.autograd.Function):
    """allreduce / grouped_allreduce.  The gradient is reduced like the values were."""

    @staticmethod
    def forward(ctx, grouped: bool, name: Optional[str], opts: _ReduceOptions, *tensors):
        ctx.grouped, ctx.opts = grouped, opts
        if grouped:
            return synchronize(grouped_allreduce_async(list(tensors), name=name, **opts))
        return synchronize(allreduce_async(tensors[0], name=name, **opts))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.grouped:
            reduced = grouped_allreduce(list(grads), **ctx.opts)
        else:
            reduced = [allreduce(grads[0], **ctx.opts)]
        return (None, None, None, *reduced)


class _Allgather(torch.autograd.Function):
    """allgather / grouped_allgather.  The gradient is averaged over the ranks, and each rank
    keeps the rows it contributed."""

    @staticmethod
    def forward(ctx, grouped: bool, name: Optional[str], process_set: ProcessSet, *tensors):
        ctx.grouped, ctx.process_set = grouped, process_set
        ctx.rows = [t.shape[0] for t in tensors]
        if grouped:
            return synchronize(grouped_allgather_async(list(tensors), name, process_set))
        return synchronize(allgather_async(tensors[0], name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        pset = ctx.process_set
        if ctx.grouped:
            averaged = grouped_allreduce(list(grads), op=Average, process_set=pset)
        else:
            averaged = [allreduce(grads[0], op=Average, process_set=pset)]
        starts = _allgather_offsets(ctx.rows, pset)
        own = [g.narrow(0, start, n) for g, start, n in zip(averaged, starts, ctx.rows)]
        return (None, None, None, *own)


def _allgather_offsets(dims: List[int], process_set: ProcessSet) -> List[int]:
    """Where this rank's rows start in each gathered tensor, given its first dimensions."""
    every = allgather(torch.tensor([dims], dtype=torch.int64), process_set=process_set)
    return every[:process_set.rank()].sum(dim=0).tolist()


class _Broadcast(torch.autograd.Function):
    """broadcast.  The root gets the gradient averaged over the ranks; the others get zeros,
    since their own values never reached the output."""

    @staticmethod
    def forward(ctx, root_rank: int, name: Optional[str], process_set: ProcessSet, tensor):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        averaged = allreduce(grad, op=Average, process_set=ctx.process_set)
        if ctx.root_rank != rank():
            averaged.mul_(0)
        return None, None, None, averaged


class _Alltoall(torch.autograd.Function):
    """alltoall.  The gradient travels back the way the rows came: an alltoall with the
    received counts as splits.  The received counts themselves have no gradient."""

    @staticmethod
    def forward(ctx, splits, name: Optional[str], process_set: ProcessSet, tensor):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *_counts_grad):
        returned, _ = alltoall(grad, splits=ctx.received, process_set=ctx.process_set)
        return None, None, None, returned


class _Reducescatter(torch.autograd.Function):
    """reducescatter / grouped_reducescatter.  The gradient is the allgather of the scaled
    incoming gradients (see _reducescatter_grad_scale)."""

    @staticmethod
    def forward(ctx, grouped: bool, name: Optional[str], opts: Dict[str, Any], *tensors):
        ctx.grouped, ctx.opts = grouped, opts
        if grouped:
            return synchronize(grouped_reducescatter_async(list(tensors), name, **opts))
        return synchronize(reducescatter_async(tensors[0], name, **opts))

    @staticmethod
    def backward(ctx, *grads):
        opts = ctx.opts
        scale = opts["prescale_factor"] * opts["postscale_factor"]
        scaled = [_reducescatter_grad_scale(g, opts["op"], scale, opts["process_set"])
                  for g in grads]
        if ctx.grouped:
            gathered = grouped_allgather(scaled, process_set=opts["process_set"])
        else:
            gathered = [allgather(scaled[0], process_set=opts["process_set"])]
        return (None, None, None, *gathered)


def _reducescatter_grad_scale(grad: torch.Tensor, op: int, scale: float,
                              process_set: ProcessSet) -> torch.Tensor:
    """Horovod's scaling of a reducescatter gradient before it is gathered: times the set size
    for Sum, unchanged for Average, then times the pre- and postscale factors."""
    if op == Sum:
        grad = grad * process_set.size()
    return grad * scale if scale != 1.0 else grad


def _compressed(compression: Type[Compressor], tensors: Sequence[torch.Tensor],
                collective: Callable[[List[torch.Tensor]], Sequence[torch.Tensor]]
                ) -> List[torch.Tensor]:
    """Run ``collective`` on the compressed ``tensors``; return its results decompressed."""
    if not tensors:
        raise ValueError("Expected at least one tensor.")
    encoded = [compression.compress(t) for t in tensors]
    results = collective([wire for wire, _ in encoded])
    return [compression.decompress(r, meta) for r, (_, meta) in zip(results, encoded)]


# ---- allreduce ----------------------------------------------------------------------------
def _allreduce_async(tensors: List[torch.Tensor], outputs: List[torch.Tensor],
                     names: array_ops.Names, op: int, prescale_factor: float, postscale_factor: float,
                     process_set: ProcessSet, finish) -> int:
    # Callers have checked the tensors (_check_tensor) before making them contiguous.
    if not tensors:
        raise ValueError("Expected at least one tensor.")
    for t in tensors:
        rop = _check_op(op, t)
    if rop == ReduceOp.ADASUM:
        array_ops.check_adasum_set(process_set)
    if len(tensors) == 1 and tensors[0].is_cpu:
        return _submit_host_allreduce(tensors[0], outputs[0], names, rop, prescale_factor,
                                      postscale_factor, process_set, finish)
    return _submit_allreduces(tensors, outputs, names, rop, prescale_factor, postscale_factor,
                              process_set, finish)


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


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[int] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` over ``process_set`` with ``op``; returns a handle.

    ``tensor`` is left alone: ``synchronize(handle)`` returns a new tensor of its shape and
    dtype.  All members must pass the same shape and dtype.
    """
    op = handle_average_backwards_compatibility(op, average)
    _check_tensor(tensor)
    src = tensor.contiguous()
    output = output_pool.empty_like(src)
    return _allreduce_async([src], [output], _name("allreduce", name), op, prescale_factor,
                            postscale_factor, process_set, lambda _: output)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[int] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`allreduce_async`: ``synchronize(handle)`` stores the result in
    ``tensor`` and returns it."""
    op = handle_average_backwards_compatibility(op, average)
    _check_tensor(tensor)
    work, copy_back = _contiguous_inplace(tensor)

    def finish(_):
        copy_back()
        return tensor
    return _allreduce_async([work], [work], _name("allreduce", name), op, prescale_factor,
                            postscale_factor, process_set, finish)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Type[Compressor] = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over ``process_set`` with ``op`` and wait; returns a new tensor of the
    same shape and dtype.

    ``compression`` encodes the tensor for the wire and decodes the result (none by
    default).  Differentiable: the gradient is reduced with the same ``op`` and factors.
    """
    opts = _reduce_options(average, op, prescale_factor, postscale_factor, process_set)
    return _compressed(compression, [tensor],
                       lambda wire: [_Allreduce.apply(False, name, opts, *wire)])[0]


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Blocking :func:`allreduce_async_`: reduces ``tensor`` in place and returns it (no
    autograd)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _group_names(prefix: str, name: Optional[str]) -> array_ops.Names:
    return array_ops.Names(prefix, f"{prefix}.{name}" if name else None, grouped=True)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """:func:`allreduce_async` of several tensors as one operation, under one handle.

    Tensors are matched across ranks by list position (``name`` is a base name, suffixed
    with the position).  ``synchronize`` returns a tuple of new tensors in list order.
    """
    op = handle_average_backwards_compatibility(op, average)
    for t in tensors:
        _check_tensor(t)
    srcs = [t.contiguous() for t in tensors]
    outputs = [output_pool.empty_like(t) for t in srcs]
    return _allreduce_async(srcs, outputs, _group_names("grouped_allreduce", name),
                            op, prescale_factor, postscale_factor, process_set,
                            lambda _: tuple(outputs))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`grouped_allreduce_async`: ``synchronize`` returns the input tensors,
    as a tuple, holding the results."""
    op = handle_average_backwards_compatibility(op, average)
    for t in tensors:
        _check_tensor(t)
    works = [_contiguous_inplace(t) for t in tensors]

    def finish(_):
        for _, copy_back in works:
            copy_back()
        return tuple(tensors)
    ws = [w for w, _ in works]
    return _allreduce_async(ws, ws, _group_names("grouped_allreduce", name), op,
                            prescale_factor, postscale_factor, process_set, finish)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None,
                      compression: Type[Compressor] = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Blocking, differentiable :func:`grouped_allreduce_async`, with ``compression`` as in
    :func:`allreduce`; returns a list of new tensors in input order."""
    opts = _reduce_options(average, op, prescale_factor, postscale_factor, process_set)
    return _compressed(compression, tensors,
                       lambda wire: _Allreduce.apply(True, name, opts, *wire))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set
                       ) -> Tuple[torch.Tensor, ...]:
    """Blocking :func:`grouped_allreduce_async_`: reduces each tensor in place and returns
    them as a tuple (no autograd)."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Allreduce of a torch.sparse tensor through two allgathers (indices and values).

    Returns a callable that produces the reduced sparse tensor.
    """
    t = tensor.coalesce()
    indices_handle = allgather_async(t._indices().t().contiguous(), name=f"{name}.indices",
                                     process_set=process_set)
    values = t._values()
    values_handle = allgather_async(values.contiguous(), name=f"{name}.values",
                                    process_set=process_set)

    def handle():
        indices = synchronize(indices_handle)
        vals = synchronize(values_handle)
        if op == Average:
            vals = vals / process_set.size()
        elif op != Sum:
            raise NotImplementedError("Only Sum and Average are supported for sparse tensors.")
        return torch.sparse_coo_tensor(indices.t(), vals, tensor.size(), dtype=tensor.dtype)
    return handle


# ---- allgather ----------------------------------------------------------------------------
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


def _allgather_async(tensors, names, process_set, finish) -> int:
    srcs = []
    for t in tensors:
        _check_tensor(t)
        if t.dim() == 0:
            raise ValueError("allgather requires tensors of rank >= 1 (got a scalar).")
        srcs.append(t.contiguous())
    outputs: List[Optional[torch.Tensor]] = [None] * len(srcs)
    return _submit(OpType.ALLGATHER, [(s, None) for s in srcs], names, process_set,
                   lambda _: finish(outputs), allocate=_allocator(outputs, srcs))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start collecting ``tensor`` from every member of ``process_set``; returns a handle.

    ``synchronize`` returns a new tensor: the members' tensors stacked along dimension 0 in
    rank order.  They must agree in dtype and in every dimension but the first.
    """
    return _allgather_async([tensor], _name("allgather", name), process_set,
                            lambda outs: outs[0])


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Blocking :func:`allgather_async`.  Differentiable: each rank's gradient is its own rows
    of the incoming gradient averaged over the ranks."""
    return _Allgather.apply(False, name, process_set, tensor)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """:func:`allgather_async` of several tensors as one operation, matched across ranks by
    list position; ``synchronize`` returns a tuple in list order."""
    return _allgather_async(list(tensors), _group_names("grouped_allgather", name),
                            process_set, tuple)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> Tuple[torch.Tensor, ...]:
    """Blocking, differentiable :func:`grouped_allgather_async` (gradient as in
    :func:`allgather`); returns a tuple."""
    return _Allgather.apply(True, name, process_set, *tensors)


# ---- broadcast ----------------------------------------------------------------------------
def _broadcast_async(tensor, output, root_rank, name, process_set, finish) -> int:
    _check_tensor(tensor)
    engine = current.engine()
    ranks, _, _ = engine.process_set_info(process_set.process_set_id) \
        if process_set.process_set_id is not None else ([], None, None)
    if root_rank not in ranks:
        raise ValueError(f"broadcast root_rank {root_rank} is not a member of {process_set} "
                         f"(ranks {ranks}).")
    return _submit(OpType.BROADCAST, [(tensor, output)], _name("broadcast", name),
                   process_set, finish, root=ranks.index(root_rank))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying ``root_rank``'s ``tensor`` to every member of ``process_set``; returns a
    handle.

    ``root_rank`` is a global rank and must belong to the set.  All members pass the same
    shape and dtype.  ``tensor`` is left alone: ``synchronize`` returns a new tensor.
    """
    _check_tensor(tensor)
    src = tensor.contiguous()
    output = output_pool.empty_like(src)
    return _broadcast_async(src, output, root_rank, name, process_set, lambda _: output)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`broadcast_async`: ``synchronize`` overwrites ``tensor`` with the root's
    values and returns it."""
    _check_tensor(tensor)
    work, copy_back = _contiguous_inplace(tensor)

    def finish(_):
        copy_back()
        return tensor
    return _broadcast_async(work, work, root_rank, name, process_set, finish)


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Blocking :func:`broadcast_async`.  Differentiable: the root's gradient is the incoming
    gradient averaged over the ranks; every other rank gets zeros."""
    return _Broadcast.apply(root_rank, name, process_set, tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Blocking :func:`broadcast_async_`: overwrites ``tensor`` with the root's values and
    returns it (no autograd)."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall -----------------------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor,
                   splits: Optional[Union[torch.Tensor, Sequence[int]]] = None,
                   name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an all-to-all exchange of the rows (dimension 0) of ``tensor``; returns a handle.

    ``splits`` gives how many rows go to each member, in rank order: an int32 tensor or a
    sequence of ints, one non-negative entry per member, adding up to at most the row count.
    Without it the rows are dealt out evenly, which needs a row count divisible by the set
    size.  Other dimensions must agree on all members.  ``synchronize`` returns ``(output,
    received)``: the rows received, concatenated in rank order, and an int32 tensor of how
    many came from each member (on ``splits``'s device when that is a tensor, else the CPU).
    """
    _check_tensor(tensor)
    if tensor.dim() == 0:
        raise ValueError("alltoall requires a tensor of rank >= 1 (got a scalar).")
    n = process_set.size() if process_set.process_set_id else size()
    dim0 = tensor.shape[0]
    given = splits
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall: splits must be an int32 tensor, got {splits.dtype}.")
        given = splits.reshape(-1).tolist()
    split_list = array_ops.alltoall_splits(dim0, given, n)
    src = tensor.contiguous()
    outputs: List[Optional[torch.Tensor]] = [None]

    def finish(results):
        # Like Horovod: (output, received splits) whether or not splits were given; the
        # received splits sit where a splits tensor was, else on the CPU.
        _, recv_rows = results[0]
        device = splits.device if isinstance(splits, torch.Tensor) else "cpu"
        return outputs[0], torch.tensor(recv_rows, dtype=torch.int32, device=device)
    return _submit(OpType.ALLTOALL, [(src, None)], _name("alltoall", name), process_set,
                   finish, allocate=_allocator(outputs, [src]), splits=tuple(split_list))


def alltoall(tensor: torch.Tensor, splits: Optional[Union[torch.Tensor, Sequence[int]]] = None,
             name: Optional[str] = None, process_set: ProcessSet = global_process_set
             ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Blocking :func:`alltoall_async`.

    Returns only the received tensor when ``splits`` is None, else ``(output, received)``.
    Differentiable in ``tensor``: the gradient is sent back with an alltoall that uses the
    received counts as splits.
    """
    return _Alltoall.apply(splits, name, process_set, tensor)


# ---- reducescatter ------------------------------------------------------------------------
def _reducescatter_async(tensors, names, op, prescale_factor, postscale_factor, process_set,
                         finish) -> int:
    array_ops.refuse_adasum_reducescatter(op)  # before the dtype checks, as in Horovod
    srcs = []
    for t in tensors:
        _check_tensor(t)
        rop = _check_op(op, t)
        if t.dim() == 0:
            raise ValueError("reducescatter requires a tensor of rank >= 1 (got a scalar).")
        srcs.append(t.contiguous())
    outputs: List[Optional[torch.Tensor]] = [None] * len(srcs)
    return _submit(OpType.REDUCESCATTER, [(s, None) for s in srcs], names, process_set,
                   lambda _: finish(outputs), allocate=_allocator(outputs, srcs),
                   reduce_op=int(rop), prescale=float(prescale_factor),
                   postscale=float(postscale_factor))


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over ``process_set`` with ``op``, each member keeping one
    block of rows of the result; returns a handle.

    Blocks follow rank order along dimension 0; when the rows do not divide evenly, the
    lowest ranks get one more row each.  All members pass the same shape and dtype.
    ``tensor`` is left alone: ``synchronize`` returns this rank's block as a new tensor.
    """
    return _reducescatter_async([tensor], _name("reducescatter", name), op, prescale_factor,
                                postscale_factor, process_set, lambda outs: outs[0])


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Type[Compressor] = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Blocking :func:`reducescatter_async`, with ``compression`` as in :func:`allreduce`.

    Differentiable: the gradient is the allgather of the incoming gradients, multiplied by
    the set size for Sum and by both scale factors.
    """
    opts = {"op": op, "process_set": process_set, "prescale_factor": prescale_factor,
            "postscale_factor": postscale_factor}
    return _compressed(compression, [tensor],
                       lambda wire: [_Reducescatter.apply(False, name, opts, *wire)])[0]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: int = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """:func:`reducescatter_async` of several tensors as one operation, matched across ranks
    by list position; ``synchronize`` returns a tuple in list order."""
    return _reducescatter_async(list(tensors),
                                _group_names("grouped_reducescatter", name), op,
                                prescale_factor, postscale_factor, process_set, tuple)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Type[Compressor] = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Blocking, differentiable :func:`grouped_reducescatter_async` (gradient as in
    :func:`reducescatter`); returns a list in input order."""
    opts = {"op": op, "process_set": process_set, "prescale_factor": prescale_factor,
            "postscale_factor": postscale_factor}
    return _compressed(compression, tensors,
                       lambda wire: _Reducescatter.apply(True, name, opts, *wire))


# ---- control ------------------------------------------------------------------------------
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
