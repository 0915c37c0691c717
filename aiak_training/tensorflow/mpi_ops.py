"""Collective operations on TensorFlow tensors (the ``horovod.tensorflow.mpi_ops`` API).

Every function here works eagerly and inside ``tf.function`` (see ``_bridge`` for how).
What holds for all of them:

* Inputs are ``tf.Tensor``s or anything ``tf.convert_to_tensor`` takes (``tf.Variable``s
  are read).  Results are new tensors; the inputs are never written.
* ``name`` identifies the operation across the members of ``process_set`` (all ranks by
  default).  Left out, an eager call draws one from a per-set counter, so unnamed eager
  calls must come in the same order on every rank; in a graph the name is the op's own,
  derived like Horovod's from the input tensor's name (and the name scope unless
  ``ignore_name_scope``), which is the same on every rank that traced the same code.
* Collectives in one graph run in the order they were created, on every rank.
* The reductions of this module default to ``Sum`` (the public ``allreduce`` and
  ``reducescatter`` of the package default to ``Average``), as in Horovod.
* Floating-point results are differentiable, with Horovod's gradients.
"""
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from aiak_training.common.dtypes import (Adasum, Average, Max, Min, Product, Sum,  # noqa: F401
                                         handle_average_backwards_compatibility)
from aiak_training.common.exceptions import HorovodInternalError  # noqa: F401
from aiak_training.runtime import basics as _basics
from aiak_training.runtime import current
from aiak_training.runtime.arrays import array_ops
from aiak_training.runtime.basics import (add_process_set, ccl_built, cross_rank,  # noqa: F401
                                         cross_size, cuda_built, ddl_built, gloo_built,
                                         gloo_enabled, is_homogeneous, is_initialized,
                                         local_rank, local_size, mpi_built, mpi_enabled,
                                         mpi_threads_supported, nccl_built, rank,
                                         remove_process_set, rocm_built, shutdown, size,
                                         start_timeline, stop_timeline)
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set  # noqa: F401
from aiak_training.tensorflow import _bridge


TensorLike = Union[tf.Tensor, tf.Variable, np.ndarray, Sequence]


def init(comm=None, process_sets=None) -> None:
    if _basics.is_initialized():
        if process_sets is not None:
            _basics.init(comm, process_sets)  # takes the registered sets' ids, as Horovod
        return
    _basics.init(comm, process_sets)
    array_ops.reset_names()


init.__doc__ = _basics.init.__doc__


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a positive power of two."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


# ---- helpers ------------------------------------------------------------------------------
def _inputs(values: Sequence[TensorLike], name: Optional[str]) -> List[tf.Tensor]:
    """The values as tensors, every one of a type the engine moves; the engine must run."""
    current.engine()  # "not initialized" before anything else
    tensors = [tf.convert_to_tensor(v) for v in values]
    for t in tensors:
        _bridge.check_dtype(t.dtype, _bridge.describe(t, name))
    return tensors


def _names(prefix: str, name: Optional[str], graph_name: Optional[str],
           grouped: bool) -> array_ops.Names:
    if graph_name is not None:
        return array_ops.Names(prefix, graph_name, grouped)
    return array_ops.Names(prefix, f"{prefix}.{name}" if name else None, grouped)


def _label(kind: str, name: Optional[str], tensors: Sequence[tf.Tensor]) -> str:
    """The graph op's name: ``name`` if given, else Horovod's ``Horovod<Kind>_<input>``."""
    if name or tf.executing_eagerly():
        return name or kind
    if len(tensors) == 1:
        return f"Horovod{kind}_{tensors[0].name}"
    return f"HorovodGrouped{kind}_{tensors[0].name}_{tensors[-1].name}"


def _is_member(process_set: ProcessSet) -> bool:
    """Whether this rank belongs to the registered ``process_set``."""
    sid = process_set.process_set_id
    return sid is not None and current.engine().process_set_info(sid)[2] is not None


def _check_member(process_set: ProcessSet) -> None:
    """Refuse a process set that is not registered, now; one this rank is not in, as
    Horovod does, when the op runs: eagerly that is now, in a graph when the graph runs
    (both ``tf.errors.InvalidArgumentError``)."""
    try:
        array_ops.set_rank(process_set)
    except ValueError as exc:
        sid = process_set.process_set_id
        try:
            known = sid is not None and current.engine().process_set_info(sid) is not None
        except ValueError:
            known = False
        if not known:
            raise
        if tf.executing_eagerly():
            raise _bridge.invalid_argument(exc) from exc


def _data_type(tensor: tf.Tensor):
    return array_ops.check_data_type(tensor.dtype.as_numpy_dtype)


def _rows_dim(tensor: tf.Tensor, op: str) -> None:
    if tensor.shape.rank == 0:
        raise ValueError(f"{op} requires tensors of rank >= 1 (got a scalar).")


def _varying_rows(shape: tf.TensorShape) -> tf.TensorShape:
    """``shape`` with an unknown first dimension (gathered results)."""
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None]).concatenate(shape[1:])


Backward = Callable[[List[tf.Tensor], List[tf.Tensor]], List[Optional[tf.Tensor]]]


def _differentiable(forward: Callable[..., List[tf.Tensor]], inputs: List[tf.Tensor],
                    backward: Backward) -> List[tf.Tensor]:
    """``forward(*inputs)`` with ``backward(upstream, outputs)`` as its gradient when any
    input is floating point (only those get gradients); a missing upstream gradient is 0."""
    if not any(t.dtype.is_floating for t in inputs):
        return forward(*inputs)

    @tf.custom_gradient
    def op(*xs):
        outs = forward(*xs)

        def grad(*upstream):
            ups = [tf.zeros_like(o) if u is None else tf.convert_to_tensor(u)
                   for u, o in zip(upstream, outs)]
            return backward(ups, outs)
        return outs, grad
    return list(op(*inputs))


def _floating_only(grads: Sequence[tf.Tensor], inputs: Sequence[tf.Tensor],
                   reduce: Callable[[List[tf.Tensor]], List[tf.Tensor]]
                   ) -> List[Optional[tf.Tensor]]:
    """``reduce`` applied to the gradients of the floating-point inputs; None for others."""
    keep = [i for i, t in enumerate(inputs) if t.dtype.is_floating]
    reduced = reduce([grads[i] for i in keep]) if keep else []
    out: List[Optional[tf.Tensor]] = [None] * len(inputs)
    for i, g in zip(keep, reduced):
        out[i] = g
    return out


# ---- allreduce ----------------------------------------------------------------------------
def _allreduce_group(tensors: Sequence[TensorLike], grouped: bool, name: Optional[str],
                     op: int, prescale_factor: float, postscale_factor: float,
                     ignore_name_scope: bool, process_set: ProcessSet) -> List[tf.Tensor]:
    inputs = _inputs(tensors, name)
    if not inputs:
        return []
    for t in inputs:
        array_ops.check_reduce_op(op, _data_type(t), adasum=True)
    _check_member(process_set)
    if op == Adasum:
        array_ops.check_adasum_set(process_set)
    label = _label("Allreduce", name, inputs)
    prefix = "grouped_allreduce" if grouped else "allreduce"

    def compute(arrays, graph_name):
        return array_ops.allreduce(arrays, _names(prefix, name, graph_name, grouped), op,
                                   process_set, prescale_factor, postscale_factor)

    def forward(*xs):
        return _bridge.run(label, xs, compute, [x.dtype for x in xs], [x.shape for x in xs],
                           ignore_name_scope)

    def backward(upstream, _outs):
        # The gradient is reduced exactly as the values were.
        return _floating_only(upstream, inputs, lambda grads: _allreduce_group(
            grads, True, None, op, prescale_factor, postscale_factor, ignore_name_scope,
            process_set))
    return _differentiable(forward, inputs, backward)


def _allreduce(tensor: TensorLike, name: Optional[str] = None, op: int = Sum,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               ignore_name_scope: bool = False,
               process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Reduce a dense tensor over ``process_set`` with ``op``; same shape and type.

    The gradient is reduced with the same op and scale factors.
    """
    return _allreduce_group([tensor], False, name, op, prescale_factor, postscale_factor,
                            ignore_name_scope, process_set)[0]


def _grouped_allreduce(tensors: Sequence[TensorLike], name: Optional[str] = None,
                       op: int = Sum, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, ignore_name_scope: bool = False,
                       process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """:func:`_allreduce` of several dense tensors as one operation (one graph op, one
    submission the engine can fuse); matched across ranks by list position."""
    return _allreduce_group(list(tensors), True, name, op, prescale_factor, postscale_factor,
                            ignore_name_scope, process_set)


# ---- allgather ----------------------------------------------------------------------------
def _allgather_group(tensors: Sequence[TensorLike], grouped: bool, name: Optional[str],
                     ignore_name_scope: bool, process_set: ProcessSet) -> List[tf.Tensor]:
    inputs = _inputs(tensors, name)
    if not inputs:
        return []
    for t in inputs:
        _rows_dim(t, "allgather")
    _check_member(process_set)
    label = _label("Allgather", name, inputs)
    prefix = "grouped_allgather" if grouped else "allgather"

    def compute(arrays, graph_name):
        return array_ops.allgather(arrays, _names(prefix, name, graph_name, grouped),
                                   process_set)

    def forward(*xs):
        return _bridge.run(label, xs, compute, [x.dtype for x in xs],
                           [_varying_rows(x.shape) for x in xs], ignore_name_scope)

    def backward(upstream, _outs):
        return _floating_only(upstream, inputs, lambda grads: _own_rows(
            _allreduce_group(grads, True, None, Average, 1.0, 1.0, ignore_name_scope,
                             process_set),
            [t for t in inputs if t.dtype.is_floating], ignore_name_scope, process_set))
    return _differentiable(forward, inputs, backward)


def _own_rows(gathered: List[tf.Tensor], inputs: List[tf.Tensor], ignore_name_scope: bool,
              process_set: ProcessSet) -> List[tf.Tensor]:
    """This rank's rows of each gathered gradient: where its input's rows landed."""
    rows = tf.stack([tf.shape(x, out_type=tf.int32)[0] for x in inputs])
    every = _allgather_group([tf.reshape(rows, [1, -1])], False, None, ignore_name_scope,
                             process_set)[0]
    me = array_ops.set_rank(process_set)
    starts = tf.reduce_sum(every[:me], axis=0)
    return [g[starts[i]:starts[i] + rows[i]] for i, g in enumerate(gathered)]


def allgather(tensor: TensorLike, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate ``tensor`` from every member along dimension 0, in rank order.

    Members must agree in type and in every dimension but the first.  The gradient is the
    incoming gradient averaged over the members, of which each keeps its own rows.
    """
    return _allgather_group([tensor], False, name, ignore_name_scope, process_set)[0]


def grouped_allgather(tensors: Sequence[TensorLike], name: Optional[str] = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """:func:`allgather` of several tensors as one operation, matched by list position."""
    return _allgather_group(list(tensors), True, name, ignore_name_scope, process_set)


# ---- broadcast ----------------------------------------------------------------------------
def _broadcast_group(tensors: Sequence[TensorLike], root_rank: int, grouped: bool,
                     name: Optional[str], ignore_name_scope: bool,
                     process_set: ProcessSet) -> List[tf.Tensor]:
    """The broadcast itself, without a gradient."""
    inputs = _inputs(tensors, name)
    if not inputs:
        return []
    _check_member(process_set)
    array_ops.root_index(process_set, root_rank)
    label = _label("Broadcast", name, inputs)
    prefix = "grouped_broadcast" if grouped else "broadcast"

    def compute(arrays, graph_name):
        return array_ops.broadcast(arrays, root_rank,
                                   _names(prefix, name, graph_name, grouped), process_set)
    return _bridge.run(label, inputs, compute, [x.dtype for x in inputs],
                       [x.shape for x in inputs], ignore_name_scope)


def broadcast(tensor: TensorLike, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every member (``root_rank`` is a global rank of the
    set; all members pass the same shape and type).

    The gradient is the incoming gradient averaged over the members on the root, and zeros
    elsewhere, since no other rank's value reached the result.
    """
    (x,) = _inputs([tensor], name)

    def forward(value):
        return _broadcast_group([value], root_rank, False, name, ignore_name_scope,
                                process_set)

    def backward(upstream, _outs):
        averaged = _allreduce_group(upstream, False, None, Average, 1.0, 1.0,
                                    ignore_name_scope, process_set)[0]
        return [averaged if rank() == root_rank else averaged * 0]
    return _differentiable(forward, [x], backward)[0]


def broadcast_(variables: Sequence[tf.Variable], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """Overwrite ``variables`` with ``root_rank``'s values; returns their new values.

    All variables travel in one operation, matched across ranks by list position.
    """
    variables = list(variables)
    values = _broadcast_group([tf.convert_to_tensor(v) for v in variables], root_rank, True,
                              name, False, process_set)
    updates = [u for u in (v.assign(x) for v, x in zip(variables, values)) if u is not None]
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies(updates):
        # A fresh read after the assignments: converting a TF1 RefVariable would return
        # its snapshot, a tensor made with the variable, which no control edge can order.
        return [v.read_value() if hasattr(v, "read_value") else tf.identity(v)
                for v in variables]


# ---- alltoall -----------------------------------------------------------------------------
def alltoall(tensor: TensorLike, splits: Optional[TensorLike] = None,
             name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set
             ) -> Union[tf.Tensor, Tuple[tf.Tensor, tf.Tensor]]:
    """Send rows (dimension 0) of ``tensor`` to every member and receive theirs.

    ``splits`` (integers, one per member in rank order, adding up to at most the row count)
    says how many rows go to each; without it the rows are dealt out evenly.  Returns the
    rows received, concatenated in rank order, and, when ``splits`` is given, an int32
    tensor of how many came from each member.  The gradient goes back the way the rows
    came: an alltoall that uses the received counts as splits.
    """
    (x,) = _inputs([tensor], name)
    _rows_dim(x, "alltoall")
    _check_member(process_set)
    members = array_ops.set_size(process_set)
    split_tensor = (tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int32)
                    if splits is not None else tf.zeros([0], tf.int32))
    # Rows and splits are checked when the op runs, as Horovod's op checks them: a bad
    # combination is tf.errors.InvalidArgumentError, eagerly and in a graph.
    label = _label("Alltoall", name, [x])

    def compute(arrays, graph_name):
        data, sent = arrays
        return array_ops.alltoall(data, None if splits is None else sent,
                                  _names("alltoall", name, graph_name, False), process_set)

    def forward(value):
        return _bridge.run(label, [value, split_tensor], compute, [value.dtype, tf.int32],
                           [_varying_rows(value.shape), tf.TensorShape([members])],
                           ignore_name_scope)

    def backward(upstream, outs):
        returned, _ = alltoall(upstream[0], splits=outs[1],
                               ignore_name_scope=ignore_name_scope, process_set=process_set)
        return [returned]
    output, received = _differentiable(forward, [x], backward)
    return (output, received) if splits is not None else output


# ---- reducescatter ------------------------------------------------------------------------
def _scattered_rows(shape: tf.TensorShape, process_set: ProcessSet) -> tf.TensorShape:
    """This rank's share of the rows, when the row count is known while tracing."""
    if shape.rank is None or shape[0] is None:
        return _varying_rows(shape)
    if not _is_member(process_set):
        return _varying_rows(shape)  # the op fails when it runs (see _check_member)
    members, me = array_ops.set_size(process_set), array_ops.set_rank(process_set)
    base, extra = divmod(shape[0], members)
    return tf.TensorShape([base + (1 if me < extra else 0)]).concatenate(shape[1:])


def _reducescatter_group(tensors: Sequence[TensorLike], grouped: bool, name: Optional[str],
                         op: int, ignore_name_scope: bool, process_set: ProcessSet,
                         prescale_factor: float, postscale_factor: float) -> List[tf.Tensor]:
    array_ops.refuse_adasum_reducescatter(op)  # before the dtype checks, as in Horovod
    inputs = _inputs(tensors, name)
    if not inputs:
        return []
    for t in inputs:
        array_ops.check_reduce_op(op, _data_type(t))
        _rows_dim(t, "reducescatter")
    _check_member(process_set)
    label = _label("Reducescatter", name, inputs)
    prefix = "grouped_reducescatter" if grouped else "reducescatter"

    def compute(arrays, graph_name):
        return array_ops.reducescatter(arrays, _names(prefix, name, graph_name, grouped), op,
                                       process_set, prescale_factor, postscale_factor)

    def forward(*xs):
        return _bridge.run(label, xs, compute, [x.dtype for x in xs],
                           [_scattered_rows(x.shape, process_set) for x in xs],
                           ignore_name_scope)

    def backward(upstream, _outs):
        # Horovod's rule: times the set size for Sum (Average is left alone), times both
        # scale factors, then gathered back to the input's rows.
        factor = (array_ops.set_size(process_set) if op == Sum else 1) * \
            prescale_factor * postscale_factor
        scaled = [g * tf.cast(factor, g.dtype) if factor != 1 else g for g in upstream]
        return _floating_only(scaled, inputs, lambda grads: _allgather_group(
            grads, True, None, ignore_name_scope, process_set))
    return _differentiable(forward, inputs, backward)


def _reducescatter(tensor: TensorLike, name: Optional[str] = None, op: int = Sum,
                   ignore_name_scope: bool = False,
                   process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over the members with ``op``, each keeping its block of rows (rank order;
    the lowest ranks get one more row when the rows do not divide evenly).

    The gradient is the allgather of the incoming gradients, times the set size for Sum
    and times both scale factors.
    """
    return _reducescatter_group([tensor], False, name, op, ignore_name_scope, process_set,
                                prescale_factor, postscale_factor)[0]


def _grouped_reducescatter(tensors: Sequence[TensorLike], name: Optional[str] = None,
                           op: int = Sum, ignore_name_scope: bool = False,
                           process_set: ProcessSet = global_process_set,
                           prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0) -> List[tf.Tensor]:
    """:func:`_reducescatter` of several tensors as one operation."""
    return _reducescatter_group(list(tensors), True, name, op, ignore_name_scope,
                                process_set, prescale_factor, postscale_factor)


# ---- control and queries ------------------------------------------------------------------
def _scalar(value: int) -> np.ndarray:
    out = array_ops.empty((), np.int32)
    out[()] = value
    return out


def _int_op(label: str, value: Callable[[], int]) -> tf.Tensor:
    """An int32 scalar computed when the op runs (at once, when eager)."""
    return _bridge.run(label, [], lambda _arrays, _name: [_scalar(value())], [tf.int32],
                       [tf.TensorShape([])])[0]


def join() -> tf.Tensor:
    """Say that this rank has no more data, and wait until every rank has said so.

    Meanwhile the collectives the other ranks still issue go ahead, with this rank taking
    part with zeros.  Returns an int32 scalar: the rank that joined last.
    """
    current.engine()
    return _int_op("HorovodJoin", array_ops.join)


def barrier(process_set: ProcessSet = global_process_set):
    """Wait until every member of ``process_set`` has called barrier.  In a graph, returns
    the op that waits; eagerly, None."""
    _check_member(process_set)
    waited = _int_op("HorovodBarrier", lambda: array_ops.barrier(process_set) or 0)
    return None if tf.executing_eagerly() else waited.op


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks in process set ``process_set_id``, read when the op runs."""
    return _int_op(name or "HorovodSize",
                   lambda: current.engine().process_set_info(process_set_id)[1])


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this machine, read when the op runs."""
    return _int_op(name or "HorovodLocalSize", local_size)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank, read when the op runs."""
    return _int_op(name or "HorovodRank", rank)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its machine, read when the op runs."""
    return _int_op(name or "HorovodLocalRank", local_rank)


# Horovod's codes for process_set_included_op.
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _included(process_set_id: int) -> int:
    if process_set_id == 0:
        return 1
    if not current.is_initialized():
        return PROCESS_SET_ERROR_INIT
    try:
        _, _, member_rank = current.engine().process_set_info(process_set_id)
    except ValueError:
        return PROCESS_SET_ERROR_UNKNOWN_SET
    return int(member_rank is not None)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this process belongs to process set ``process_set_id``, else 0; -1 before
    ``init``, -3 for an unknown set (Horovod's codes).  Read when the op runs."""
    return _int_op(name or "HorovodProcessSetIncluded", lambda: _included(process_set_id))
