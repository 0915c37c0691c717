"""Collective operations on torch tensors (the ``horovod.torch.mpi_ops`` API).

Thin adapters: a tensor becomes (address, dtype, shape) for the engine, and the engine's
completion becomes a tensor again.  No framework C++ is involved.
"""
import itertools
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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
from aiak_training.common.dtypes import DataType, ReduceOp
from aiak_training.runtime.entries import TensorEntry
from aiak_training.common.exceptions import HorovodInternalError  # noqa: F401
from aiak_training.common.messages import OpType, Request
from aiak_training.runtime.process_sets import ProcessSet, global_process_set
from aiak_training.torch.compression import Compression
from aiak_training.torch import cuda as _cuda
from aiak_training.torch import output_pool

Average = int(ReduceOp.AVERAGE)
Sum = int(ReduceOp.SUM)
Adasum = int(ReduceOp.ADASUM)
Min = int(ReduceOp.MIN)
Max = int(ReduceOp.MAX)
Product = int(ReduceOp.PRODUCT)

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
# Auto-generated names count per process set: they must agree among a set's members only.
_noname: Dict[int, "itertools.count"] = {}
_noname_lock = threading.Lock()


def init(comm=None, process_sets=None) -> None:
    if _basics.is_initialized():
        return
    _basics.init(comm, process_sets)
    _handle_map.clear()
    _noname.clear()


init.__doc__ = _basics.init.__doc__


def handle_average_backwards_compatibility(op: Optional[int], average: Optional[bool]) -> int:
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0", DeprecationWarning)
        return Average if average else Sum
    return Average


# ---- helpers ------------------------------------------------------------------------------
def _dtype(tensor: torch.Tensor) -> DataType:
    dt = _DTYPES.get(tensor.dtype)
    if dt is None:
        raise ValueError(f"Tensor type {tensor.dtype} is not supported.")
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
        raise NotImplementedError("Adasum is not supported by aiak_training yet.")
    if tensor.dtype == torch.bool and rop == ReduceOp.AVERAGE:
        raise ValueError("Average is not supported for bool tensors; use Sum/Max (logical or) "
                         "or Min/Product (logical and).")
    return rop


class _Names:
    """Op names, made only once an op is known to be valid.

    Auto-generated names count successful submissions, so ranks that take a different
    error path (an invalid call that raises) still agree on the next generated name.
    """

    def __init__(self, prefix: str, name: Optional[str], group: Optional[int] = None):
        self.prefix, self.name, self.group = prefix, name, group

    def resolve(self, count: int, set_id: int) -> List[str]:
        if self.name:
            base = f"{self.prefix}.{self.name}"
        else:
            with _noname_lock:
                counter = _noname.setdefault(set_id, itertools.count())
                base = f"{self.prefix}.noname.{next(counter)}"
        if self.group is None:
            return [base]
        return [f"{base}_{i}" for i in range(count)]


def _name(prefix: str, name: Optional[str]) -> "_Names":
    return _Names(prefix, name)


def _set_rank(engine, process_set: ProcessSet) -> int:
    sid = process_set.process_set_id
    if sid is None:
        raise ValueError(f"{process_set} has not been registered (hvd.add_process_set).")
    set_rank = engine.rank_in_set(sid)
    if set_rank is not None:
        return set_rank
    ranks, _, set_rank = engine.process_set_info(sid)  # raises if the set is unknown
    if set_rank is None:
        raise ValueError(f"Rank {engine.topology.rank} is not part of {process_set}; only its "
                         f"members {ranks} may run collectives on it.")
    return set_rank


def _submit(op_type: OpType, pairs: List[Tuple[torch.Tensor, Optional[torch.Tensor]]],
            names: "_Names", process_set: ProcessSet, finish: Callable[[List[Any]], Any],
            allocate: Optional[Callable[[int], Callable]] = None, **fields) -> int:
    """Enqueue one request per (input, output) pair; return a single user handle."""
    if not pairs:
        raise ValueError("Expected at least one tensor.")
    engine = current.engine()
    set_rank = _set_rank(engine, process_set)
    dtypes = [_dtype(inp) for inp, _ in pairs]  # all valid before a name is taken
    on_gpu = pairs[0][0].is_cuda
    if len(pairs) > 1 and any(inp.is_cuda != on_gpu for inp, _ in pairs):
        raise ValueError("A grouped operation takes tensors on one kind of device: got CPU and "
                         "CUDA tensors mixed.")
    names = names.resolve(len(pairs), process_set.process_set_id)
    requests, entries, streams = [], [], []
    device = -1
    for i, ((inp, out), name, dt) in enumerate(zip(pairs, names, dtypes)):
        shape = tuple(inp.shape)
        stream, event = None, 0
        if on_gpu:
            device, stream, event = _cuda.ready(inp)
            streams.append(stream)
        # Positional arguments: this runs once per tensor per step.
        requests.append(Request(set_rank, name, op_type, int(dt), shape, device=device,
                                **fields))
        entries.append(TensorEntry(name, dt, shape, inp.data_ptr(),
                                   out.data_ptr() if out is not None else 0,
                                   allocate(i, stream) if allocate else None, -1, None,
                                   (inp, out), device,
                                   int(stream.cuda_stream) if on_gpu else 0, event))
    handles = engine.enqueue(process_set.process_set_id, requests, entries)
    user_handle = handles[0]

    def complete():
        done = [engine.wait(h) for h in handles]
        if on_gpu:
            # The engine's stream may still be working: the consumer's stream waits for it.
            # Until then the inputs stay referenced here, so their memory is not reused.
            for h, stream in zip(done, streams):
                _cuda.consume(device, h.event, stream)
            del pairs[:]
        return finish([h.result for h in done])
    _handle_map[user_handle] = complete
    if on_gpu:
        _gpu_handles[user_handle] = handles
    return user_handle


def _contiguous_inplace(tensor: torch.Tensor) -> Tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous working copy for in-place ops on non-contiguous tensors, and a copy-back."""
    if tensor.is_contiguous():
        return tensor, lambda: None
    work = tensor.contiguous()
    return work, lambda: tensor.copy_(work)


# ---- allreduce ----------------------------------------------------------------------------
def _allreduce_async(tensors: List[torch.Tensor], outputs: List[torch.Tensor], names: "_Names",
                     op: int, prescale_factor: float, postscale_factor: float,
                     process_set: ProcessSet, finish) -> int:
    # Callers have checked the tensors (_check_tensor) before making them contiguous.
    if not tensors:
        raise ValueError("Expected at least one tensor.")
    for t in tensors:
        rop = _check_op(op, t)
    return _submit(OpType.ALLREDUCE, list(zip(tensors, outputs)), names, process_set, finish,
                   reduce_op=int(rop), prescale=float(prescale_factor),
                   postscale=float(postscale_factor))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """
    A function that performs asynchronous averaging or summation of the input tensor
    over all the Horovod processes. The input tensor is not modified.

    The reduction operation is keyed by the name. If name is not provided, an incremented
    auto-generated name is used. The tensor type and shape must be the same on all
    Horovod processes for a given name. The reduction will not start until all processes
    are ready to send and receive the tensor.

    Arguments:
        tensor: A tensor to reduce.
        average:
            .. warning:: .. deprecated:: 0.19.0

                Use `op` instead. Will be removed in v1.0.

        name: A name of the reduction operation.
        op: The reduction operation to combine tensors across different ranks. Defaults
            to Average if None is given.
        prescale_factor: Multiplicative factor to scale tensor before allreduce.
        postscale_factor: Multiplicative factor to scale tensor after allreduce.
        process_set: Process set object to limit this operation to a subset of
            Horovod processes. Default is the global process set.

    Returns:
        A handle to the allreduce operation that can be used with `poll()` or
        `synchronize()`.
    """
    op = handle_average_backwards_compatibility(op, average)
    _check_tensor(tensor)
    src = tensor.contiguous()
    output = output_pool.empty_like(src)
    return _allreduce_async([src], [output], _name("allreduce", name), op, prescale_factor,
                            postscale_factor, process_set, lambda _: output)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """
    A function that performs asynchronous in-place averaging or summation of the input
    tensor over all the Horovod processes.

    The reduction operation is keyed by the name. If name is not provided, an incremented
    auto-generated name is used. The tensor type and shape must be the same on all
    Horovod processes for a given name. The reduction will not start until all processes
    are ready to send and receive the tensor.

    Returns:
        A handle to the allreduce operation that can be used with `poll()` or
        `synchronize()`.
    """
    op = handle_average_backwards_compatibility(op, average)
    _check_tensor(tensor)
    work, copy_back = _contiguous_inplace(tensor)

    def finish(_):
        copy_back()
        return tensor
    return _allreduce_async([work], [work], _name("allreduce", name), op, prescale_factor,
                            postscale_factor, process_set, finish)


class HorovodAllreduce(torch.autograd.Function):
    """An autograd function that performs allreduce on a tensor."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.average, ctx.op = average, op
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        ctx.process_set = process_set
        handle = allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                 process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        return allreduce(grad_output, average=ctx.average, op=ctx.op,
                         prescale_factor=ctx.prescale_factor,
                         postscale_factor=ctx.postscale_factor,
                         process_set=ctx.process_set), None, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """
    A function that performs averaging or summation of the input tensor over all the
    Horovod processes. The input tensor is not modified.

    The reduction operation is keyed by the name. If name is not provided, an incremented
    auto-generated name is used. The tensor type and shape must be the same on all
    Horovod processes for a given name. The reduction will not start until all processes
    are ready to send and receive the tensor.

    This acts as a thin wrapper around an autograd function.  If your input
    tensor requires gradients, then callings this function will allow gradients
    to be computed and backpropagated.

    Arguments:
        tensor: A tensor to reduce.
        average:
            .. warning:: .. deprecated:: 0.19.0

                Use `op` instead. Will be removed in v1.0.

        name: A name of the reduction operation.
        compression: Compression algorithm used during allreduce to reduce the amount
                     of data sent during the each parameter update step.  Defaults to
                     not using compression.
        op: The reduction operation to combine tensors across different ranks. Defaults
            to Average if None is given.
        prescale_factor: Multiplicative factor to scale tensor before allreduce.
        postscale_factor: Multiplicative factor to scale tensor after allreduce.
        process_set: Process set object to limit this operation to a subset of
            Horovod processes. Default is the global process set.

    Returns:
        A tensor of the same shape and type as `tensor`, averaged or summed across all
        processes.
    """
    tensor_compressed, ctx = compression.compress(tensor)
    summed_tensor_compressed = HorovodAllreduce.apply(tensor_compressed, average, name, op,
                                                      prescale_factor, postscale_factor,
                                                      process_set)
    return compression.decompress(summed_tensor_compressed, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """
    A function that performs in-place averaging or summation of the input tensor over
    all the Horovod processes.

    Returns:
        A tensor of the same shape and type as `tensor`, averaged or summed across all
        processes.
    """
    handle = allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                              process_set)
    return synchronize(handle)


def _group_names(prefix: str, name: Optional[str], n: int) -> "_Names":
    return _Names(prefix, name, group=n)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """
    A function that performs asynchronous averaging or summation of the input tensor
    list over all the Horovod processes. The input tensors are not modified.

    The reduction operations are keyed by the base name. If a base name is not
    provided, an incremented auto-generated base name is used. Reductions are
    performed across tensors in the same list position. The tensor type and shape must
    be the same on all Horovod processes for tensors sharing positions in the input
    tensor list. The reduction will not start until all processes are ready to send and
    receive the tensors.

    Returns:
        A handle to the group allreduce operation that can be used with `poll()` or
        `synchronize()`.
    """
    op = handle_average_backwards_compatibility(op, average)
    for t in tensors:
        _check_tensor(t)
    srcs = [t.contiguous() for t in tensors]
    outputs = [output_pool.empty_like(t) for t in srcs]
    return _allreduce_async(srcs, outputs, _group_names("grouped_allreduce", name, len(srcs)),
                            op, prescale_factor, postscale_factor, process_set,
                            lambda _: tuple(outputs))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """
    A function that performs asynchronous in-place averaging or summation of the input
    tensors over all the Horovod processes.

    Returns:
        A handle to the group allreduce operation that can be used with `poll()` or
        `synchronize()`.
    """
    op = handle_average_backwards_compatibility(op, average)
    for t in tensors:
        _check_tensor(t)
    works = [_contiguous_inplace(t) for t in tensors]

    def finish(_):
        for _, copy_back in works:
            copy_back()
        return tuple(tensors)
    ws = [w for w, _ in works]
    return _allreduce_async(ws, ws, _group_names("grouped_allreduce", name, len(ws)), op,
                            prescale_factor, postscale_factor, process_set, finish)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """An autograd function that performs allreduce on a list of tensors."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.average, ctx.op = average, op
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        ctx.process_set = process_set
        handle = grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                         postscale_factor, process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, *grad_output):
        grad_reduced = grouped_allreduce(list(grad_output), average=ctx.average, op=ctx.op,
                                         prescale_factor=ctx.prescale_factor,
                                         postscale_factor=ctx.postscale_factor,
                                         process_set=ctx.process_set)
        return (None, None, None, None, None, None, *grad_reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """
    A function that performs averaging or summation of the input tensor
    list over all the Horovod processes. The input tensors are not modified.

    This acts as a thin wrapper around an autograd function.  If your input
    tensors require gradients, then calling this function will allow gradients
    to be computed and backpropagated.

    Returns:
        A list containing tensors of the same shape and type as in `tensors`,
        averaged or summed across all processes.
    """
    tensors_compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    summed = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                           process_set, *tensors_compressed)
    return [compression.decompress(t, ctx) for t, ctx in zip(summed, ctxs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """
    A function that performs in-place averaging or summation of the input tensors over
    all the Horovod processes.

    Returns:
        A list containing tensors of the same shape and type as in `tensors`,
        averaged or summed across all processes.
    """
    handle = grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                      postscale_factor, process_set)
    return synchronize(handle)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
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


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """
    A function that asynchronously concatenates the input tensor with the same input
    tensor on all other Horovod processes. The input tensor is not modified.

    The concatenation is done on the first dimension, so the input tensors on the
    different processes must have the same rank and shape, except for the first
    dimension, which is allowed to be different.

    Returns:
        A handle to the allgather operation that can be used with `poll()` or
        `synchronize()`.
    """
    return _allgather_async([tensor], _name("allgather", name), process_set,
                            lambda outs: outs[0])


class HorovodAllgather(torch.autograd.Function):
    """An autograd function that performs allgather on a tensor."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim = tensor.shape[0]
        ctx.process_set = process_set
        handle = allgather_async(tensor, name, process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        # Averaged over the ranks, as Horovod does (every frontend): the gradient of the mean
        # of the ranks' losses.
        grad_reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        offset = _allgather_offsets([ctx.dim], ctx.process_set)[0]
        return grad_reduced.narrow(0, offset, ctx.dim), None, None


def _allgather_offsets(dims: List[int], process_set: ProcessSet) -> List[int]:
    """Where this rank's rows start in each gathered tensor, given its first dimensions."""
    every = allgather(torch.tensor([dims], dtype=torch.int64), process_set=process_set)
    return every[:process_set.rank()].sum(dim=0).tolist()


def allgather(tensor, name=None, process_set=global_process_set):
    """
    A function that concatenates the input tensor with the same input tensor on
    all other Horovod processes. The input tensor is not modified.

    The concatenation is done on the first dimension, so the input tensors on the
    different processes must have the same rank and shape, except for the first
    dimension, which is allowed to be different.

    This acts as a thin wrapper around an autograd function.  If your input
    tensor requires gradients, then callings this function will allow gradients
    to be computed and backpropagated.

    Returns:
        A tensor of the same type as `tensor`, concatenated on dimension zero
        across all processes. The shape is identical to the input shape, except for
        the first dimension, which may be greater and is the sum of all first
        dimensions of the tensors in different Horovod processes.
    """
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """
    A function that asynchronously concatenates each input tensor with the corresponding
    input tensor on all other Horovod processes for a list of input tensors.

    Returns:
        A handle to the group allgather operation that can be used with `poll()` or
        `synchronize()`.
    """
    return _allgather_async(list(tensors), _group_names("grouped_allgather", name, len(tensors)),
                            process_set, tuple)


class HorovodGroupedAllgather(torch.autograd.Function):
    """An autograd function that performs allgather on a list of tensors."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] for t in tensors]
        ctx.process_set = process_set
        return synchronize(grouped_allgather_async(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx, *grad_output):
        grad_reduced = grouped_allreduce(list(grad_output), op=Average,
                                         process_set=ctx.process_set)
        offsets = _allgather_offsets(ctx.dims, ctx.process_set)
        return (None, None, *[g.narrow(0, off, dim)
                              for g, off, dim in zip(grad_reduced, offsets, ctx.dims)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """
    A function that concatenates each input tensor with the corresponding input tensor
    on all other Horovod processes for a list of input tensors.

    This acts as a thin wrapper around an autograd function.  If your input
    tensors require gradients, then calling this function will allow gradients
    to be computed and backpropagated.

    Returns:
        A list containing tensors of the same type as in `tensors`. Each tensor is
        concatenated on dimension zero across all processes.
    """
    return HorovodGroupedAllgather.apply(name, process_set, *tensors)


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


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """
    A function that asynchronously broadcasts the input tensor on root rank to the same
    input tensor on all other Horovod processes. The input tensor is not modified.

    The broadcast operation is keyed by the name. If name is not provided, an incremented
    auto-generated name is used. The tensor type and shape must be the same on all
    Horovod processes for a given name. The broadcast will not start until all processes
    are ready to send and receive the tensor.

    Returns:
        A handle to the broadcast operation that can be used with `poll()` or
        `synchronize()`.
    """
    _check_tensor(tensor)
    src = tensor.contiguous()
    output = output_pool.empty_like(src)
    return _broadcast_async(src, output, root_rank, name, process_set, lambda _: output)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """
    A function that asynchronously broadcasts the input tensor on root rank to the same
    input tensor on all other Horovod processes. The operation is performed in-place.

    Returns:
        A handle to the broadcast operation that can be used with `poll()` or
        `synchronize()`.
    """
    _check_tensor(tensor)
    work, copy_back = _contiguous_inplace(tensor)

    def finish(_):
        copy_back()
        return tensor
    return _broadcast_async(work, work, root_rank, name, process_set, finish)


class HorovodBroadcast(torch.autograd.Function):
    """An autograd function that broadcasts a tensor."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        handle = broadcast_async(tensor, root_rank, name, process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)  # as Horovod
        if rank() != ctx.root_rank:
            grad_reduced *= 0
        return grad_reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """
    A function that broadcasts the input tensor on root rank to the same input tensor
    on all other Horovod processes. The input tensor is not modified.

    This acts as a thin wrapper around an autograd function.  If your input
    tensor requires gradients, then callings this function will allow gradients
    to be computed and backpropagated.

    Returns:
        A tensor of the same shape and type as `tensor`, with the value broadcasted
        from root rank.
    """
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """
    A function that broadcasts the input tensor on root rank to the same input tensor
    on all other Horovod processes. The operation is performed in-place.

    Returns:
        A tensor of the same shape and type as `tensor`, with the value broadcasted
        from root rank.
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall -----------------------------------------------------------------------------
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """
    A function that scatters slices of the input tensor to all other Horovod processes
    and returns a tensor of gathered slices from all other Horovod processes. The input
    tensor is not modified.

    The slicing is done on the first dimension, so the input tensors on
    the different processes must have the same rank and shape, except for the
    first dimension, which is allowed to be different.

    Arguments:
        tensor: A tensor to distribute with alltoall.
        splits: A tensor of integers in rank order describing how many
                elements in `tensor` to send to each worker.  Splitting is
                applied along the first dimension of `tensor`. If `splits` is
                not provided, the first dimension is split equally by the
                number of Horovod processes.
        name: A name of the alltoall operation.
        process_set: Process set object to limit this operation to a subset of
                     Horovod processes. Default is the global process set.

    Returns:
        A handle to the alltoall operation that can be used with `poll()` or
        `synchronize()`.
    """
    _check_tensor(tensor)
    if tensor.dim() == 0:
        raise ValueError("alltoall requires a tensor of rank >= 1 (got a scalar).")
    n = process_set.size() if process_set.process_set_id else size()
    dim0 = tensor.shape[0]
    if splits is None:
        if dim0 % n != 0:
            raise ValueError(f"alltoall: tensor dimension 0 ({dim0}) is not divisible by the "
                             f"number of processes ({n}); pass splits explicitly.")
        split_list = [dim0 // n] * n
    else:
        if isinstance(splits, torch.Tensor):
            if splits.dtype != torch.int32:
                raise ValueError(f"alltoall: splits must be an int32 tensor, got {splits.dtype}.")
            split_list = [int(s) for s in splits.reshape(-1).tolist()]
        else:
            split_list = [int(s) for s in splits]
        if len(split_list) != n:
            raise ValueError(f"alltoall: splits has {len(split_list)} entries; expected one per "
                             f"process ({n}).")
        if any(s < 0 for s in split_list):
            raise ValueError("alltoall: splits must be non-negative.")
        if sum(split_list) > dim0:
            raise ValueError(f"alltoall: sum of splits ({sum(split_list)}) exceeds tensor "
                             f"dimension 0 ({dim0}).")
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


class HorovodAlltoall(torch.autograd.Function):
    """An autograd function that performs alltoall on a tensor."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        output, recv = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.recv_splits = recv
        if splits is None:
            return output
        ctx.mark_non_differentiable(recv)
        return output, recv

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = alltoall(grad_output, splits=ctx.recv_splits, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """
    A function that scatters slices of the input tensor to all other Horovod processes
    and returns a tensor of gathered slices from all other Horovod processes. The input
    tensor is not modified.

    This acts as a thin wrapper around an autograd function.  If your input
    tensor requires gradients, then callings this function will allow gradients
    to be computed and backpropagated.

    Returns:
        1) A tensor containing the gathered tensor data from all workers.
        2) If `splits` has been provided: A tensor of integers in rank order
           describing how many elements in the output tensor have been received
           from each worker.
    """
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# ---- reducescatter ------------------------------------------------------------------------
def _reducescatter_async(tensors, names, op, prescale_factor, postscale_factor, process_set,
                         finish) -> int:
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


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """
    A function that performs asynchronous reduction of the input tensor over all the
    Horovod processes, then scatters the results across all Horovod processes. The
    input tensor is not modified.

    The reduction operation is keyed by the name. If name is not provided, an incremented
    auto-generated name is used. The tensor type and shape must be the same on all
    Horovod processes for a given name. The reduction will not start until all processes
    are ready to send and receive the tensor.

    The input tensor is split along the first dimension; when that dimension does not
    divide evenly, the lowest ranks get one extra slice each.

    Returns:
        A handle to the reducescatter operation that can be used with `poll()` or
        `synchronize()`.
    """
    return _reducescatter_async([tensor], _name("reducescatter", name), op, prescale_factor,
                                postscale_factor, process_set, lambda outs: outs[0])


class HorovodReducescatter(torch.autograd.Function):
    """An autograd function that performs reducescatter on a tensor."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op, ctx.process_set = op, process_set
        ctx.scale = prescale_factor * postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        grad = _reducescatter_grad_scale(grad_output, ctx.op, ctx.scale, ctx.process_set)
        return allgather(grad, process_set=ctx.process_set), None, None, None, None, None


def _reducescatter_grad_scale(grad: torch.Tensor, op: int, scale: float,
                              process_set: ProcessSet) -> torch.Tensor:
    """Horovod's scaling of a reducescatter gradient before it is gathered: times the set size
    for Sum, unchanged for Average, then times the pre- and postscale factors."""
    if op == Sum:
        grad = grad * process_set.size()
    return grad * scale if scale != 1.0 else grad


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """
    A function that performs reduction of the input tensor over all the Horovod
    processes, then scatters the results across all Horovod processes. The input tensor
    is not modified.

    This acts as a thin wrapper around an autograd function.  If your input
    tensor requires gradients, then callings this function will allow gradients
    to be computed and backpropagated.

    Returns:
        A tensor of the same rank and type as `tensor`, summed across all processes.
        The shape is identical to the input shape, except for the first dimension,
        which will be divided across the different Horovod processes.
    """
    tensor_compressed, ctx = compression.compress(tensor)
    reduced = HorovodReducescatter.apply(tensor_compressed, name, op, process_set,
                                         prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """
    A function that performs asynchronous reduction of a list of input tensors over all
    the Horovod processes, then scatters the results across all Horovod processes.

    Returns:
        A handle to the group reducescatter operation that can be used with `poll()` or
        `synchronize()`.
    """
    return _reducescatter_async(list(tensors),
                                _group_names("grouped_reducescatter", name, len(tensors)), op,
                                prescale_factor, postscale_factor, process_set, tuple)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """An autograd function that performs reducescatter on a list of tensors."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op, ctx.process_set = op, process_set
        ctx.scale = prescale_factor * postscale_factor
        return synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                       prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, *grad_output):
        grads = [_reducescatter_grad_scale(g, ctx.op, ctx.scale, ctx.process_set)
                 for g in grad_output]
        return (None, None, None, None, None,
                *grouped_allgather(grads, process_set=ctx.process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """
    A function that performs reduction of a list of input tensors over all the Horovod
    processes, then scatters the results across all Horovod processes.

    Returns:
        A list containing tensors of the same rank and type as in `tensors`. For each
        tensor the shape is identical to the input shape, except for the first
        dimension, which will be divided across the different Horovod processes.
    """
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                             postscale_factor, *compressed)
    return [compression.decompress(t, c) for t, c in zip(outs, ctxs)]


# ---- control ------------------------------------------------------------------------------
def poll(handle: int) -> bool:
    """
    Polls an allreduce, allgather, alltoall, broadcast, or reducescatter handle to determine
    whether underlying asynchronous operation has completed. After `poll()` returns `True`,
    `synchronize()` will return without blocking.

    Returns:
        A flag indicating whether the operation has completed.
    """
    engine = current.engine()
    if handle not in _gpu_handles:
        return engine.poll(handle)
    # Every tensor of the op is enqueued, and the device has finished all of them.
    handles = _gpu_handles[handle]
    return all(engine.poll(h) for h in handles) and \
        all(_cuda.event_done(engine.handle_event(h)) for h in handles)


def synchronize(handle: int):
    """
    Synchronizes an asynchronous allreduce, allgather, alltoall, broadcast, or reducescatter
    operation until it's completed. Returns the result of the operation.

    Returns:
        A single output tensor of the operation or a tuple of multiple output tensors.
    """
    finish = _handle_map.pop(handle, None)
    _gpu_handles.pop(handle, None)
    if finish is None:
        return None
    return finish()


def join(device: int = -1) -> int:
    """A function that indicates that the rank finished processing data.

    All ranks that did not call join() continue to process allreduce operations.
    This function blocks Python thread until all ranks join.

    Arguments:
        device: An id of the device to create temprorary zero tensors (default -1, CPU)

    Returns:
        Id of the rank that joined last.
    """
    if device is None or device < 0:
        device = _cuda.used_device()
    if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()  # a rank that joins before any GPU op
    if device is not None and device >= 0:
        # Zeros for GPU collectives that run while this rank has joined go on this device.
        current.engine().join_device = int(device)
    return int(current.engine().run_control(0, OpType.JOIN, "join"))


def barrier(process_set=global_process_set) -> None:
    """
    A function that acts as a simple sychronization point for ranks specified
    in the given process group(default to global group). Ranks that reach
    this function call will stall until all other ranks have reached.

    Arguments:
        process_set: Process set object to limit this operation to a subset of
                     Horovod processes. Default is the global process set.
    """
    engine = current.engine()
    _set_rank(engine, process_set)  # raises for a set this rank is not in
    engine.run_control(process_set.process_set_id, OpType.BARRIER, "barrier")
