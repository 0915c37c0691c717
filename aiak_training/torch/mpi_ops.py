"""Collective operations on torch tensors (the ``horovod.torch.mpi_ops`` API).

Thin adapters: a tensor becomes (address, dtype, shape) for the engine, and the engine's
completion becomes a tensor again.  No framework C++ is involved.  Handing tensors to the
engine, the handles and :func:`synchronize` are in ``submission.py``.

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
from aiak_training.common.dtypes import (Adasum, Average, Max, Min,  # noqa: F401
                                         Product, ReduceOp, Sum,
                                         handle_average_backwards_compatibility)
from aiak_training.runtime.arrays import array_ops
from aiak_training.common.exceptions import HorovodInternalError  # noqa: F401
from aiak_training.common.messages import OpType
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.torch.compression import Compression, Compressor, run_compressed
from aiak_training.torch import output_pool
from aiak_training.torch.submission import (_allocator, _check_op, _check_tensor,
                                            _contiguous_inplace, _handle_map, _name, _submit,
                                            _submit_allreduces, _submit_host_allreduce,
                                            _allgather_into, _reducescatter_into,
                                            barrier, join, poll, synchronize)  # noqa: F401


def init(comm=None, process_sets=None) -> None:
    if _basics.is_initialized():
        return
    _basics.init(comm, process_sets)
    _handle_map.clear()
    array_ops.reset_names()


init.__doc__ = _basics.init.__doc__


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
    return run_compressed(compression, [tensor],
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
    return run_compressed(compression, tensors,
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
                    process_set: ProcessSet = global_process_set,
                    out: Optional[torch.Tensor] = None) -> int:
    """Start collecting ``tensor`` from every member of ``process_set``; returns a handle.

    ``synchronize`` returns a new tensor: the members' tensors stacked along dimension 0 in
    rank order.  They must agree in dtype and in every dimension but the first.  With a flat
    ``out`` (not in Horovod), every member passes a flat tensor of one size, and the result
    is written into the first ``size * tensor.numel()`` elements of ``out``, the view that
    ``synchronize`` returns; ``tensor`` may be this rank's own block of ``out``.
    """
    if out is not None:
        return _allgather_into(tensor, out, _name("allgather", name), process_set)
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
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        out: Optional[torch.Tensor] = None) -> int:
    """Start reducing ``tensor`` over ``process_set`` with ``op``, each member keeping one
    block of rows of the result; returns a handle.

    Blocks follow rank order along dimension 0; when the rows do not divide evenly, the
    lowest ranks get one more row each.  All members pass the same shape and dtype.
    ``tensor`` is left alone: ``synchronize`` returns this rank's block as a new tensor, or
    (with ``out``, not in Horovod; a flat contiguous ``tensor`` that divides evenly) writes
    it into ``out`` and returns ``out``.
    """
    if out is not None:
        return _reducescatter_into(tensor, out, _name("reducescatter", name), op,
                                   prescale_factor, postscale_factor, process_set)
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
    return run_compressed(compression, [tensor],
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
    return run_compressed(compression, tensors,
                          lambda wire: _Reducescatter.apply(True, name, opts, *wire))
