"""The TensorFlow 1 graph API of ``horovod.tensorflow``: ``DistributedOptimizer`` around a
``tf.compat.v1.train.Optimizer``, ``broadcast_global_variables`` and
``BroadcastGlobalVariablesHook`` (for ``tf.compat.v1.train.MonitoredTrainingSession``).

These work in ``tf.compat.v1`` graphs (run by a ``Session``) and also eagerly or inside
``tf.function`` where the wrapped optimizer does.  ``DistributedOptimizer`` given a Keras
optimizer hands it to ``aiak_training.tensorflow.keras.DistributedOptimizer``, as Horovod's
does (that frontend registers itself here when imported).
"""
import contextlib
from typing import Any, Callable, List, Optional, Sequence, Type

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util

from aiak_training.common import horovod_strings as hs
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.tensorflow.compression import Compression, Compressor
from aiak_training.tensorflow.functions import broadcast_variables
from aiak_training.tensorflow.gradients import allreduce_gradients, check_gradient_options
from aiak_training.tensorflow.mpi_ops import Adasum, Average

_LegacyOptimizer = tf.compat.v1.train.Optimizer

# Keras optimizers go to the Keras frontend's DistributedOptimizer, as in Horovod.  That
# frontend sits above this package, so it registers its wrapper here when it is imported.
_keras_wrapper: Optional[Callable[..., Any]] = None


def register_keras_wrapper(wrapper: Callable[..., Any]) -> None:
    """Called by ``aiak_training.keras`` (TensorFlow backend) with its DistributedOptimizer."""
    global _keras_wrapper
    _keras_wrapper = wrapper


def broadcast_global_variables(root_rank: int) -> tf.Operation:
    """The op that overwrites every global variable of the default graph
    (``tf.compat.v1.global_variables()``) with ``root_rank``'s values.  TensorFlow 1 graphs
    only: eagerly there is no such collection (Horovod's ``RuntimeError``)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. Please use "
            "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A ``SessionRunHook`` that broadcasts all global variables from ``root_rank`` once the
    session exists, so every rank starts from the same weights (whether they were
    initialized at random or restored from a checkpoint).  ``device`` places the op."""

    def __init__(self, root_rank: int, device: str = ''):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Optional[tf.Operation] = None
        self.device = device

    def begin(self) -> None:
        # A hook may be reused with a new graph (a new MonitoredTrainingSession).
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord) -> None:
        session.run(self.bcast_op)


class _LocalAggregation:
    """``backward_passes_per_step``: gradients summed in local (non-trainable, not saved
    with the model's variables) sums; on every N-th pass the sums are reduced over the
    ranks and applied, and cleared.  In between, ``apply_gradients`` does nothing (a global
    step passed to it advances only when gradients are applied, as in Horovod).
    ``counter`` holds the passes since the last combination, as Horovod's does."""

    def __init__(self, passes: int, average: bool):
        self.passes = passes
        self.average = average
        self.sums: List[tf.Variable] = []
        self.counter: Optional[tf.Variable] = None
        self.ready: Optional[tf.Tensor] = None

    def _build(self, variables: Sequence[tf.Variable]) -> None:
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        # Outside any control flow or function being traced: the sums live across steps.
        # Resource variables, whatever the graph's default: the cond branches that clear
        # them capture them, which a TF1 RefVariable does not survive.
        with tf.init_scope():
            self.sums = [tf.compat.v1.Variable(tf.zeros(v.shape, v.dtype.base_dtype),
                                               trainable=False, collections=local,
                                               use_resource=True, name="aiak_gradient_sum")
                         for v in variables]
            self.counter = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False,
                                                 collections=local, use_resource=True,
                                                 name="aiak_backward_passes")

    def compute(self, grads: List[Any], variables: List[tf.Variable],
                reduce: Callable[[List[Any]], List[Any]]) -> List[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        if not self.sums:
            self._build([variables[i] for i in present])
        updates = [s.assign_add(tf.convert_to_tensor(grads[i]))
                   for s, i in zip(self.sums, present)]
        with tf.control_dependencies(updates):
            count = self.counter.assign_add(1)
        self.ready = tf.equal(count, self.passes)

        def reduce_and_clear():
            with tf.control_dependencies([count]):
                values = [s.read_value() for s in self.sums]
            if self.average:
                values = [v / tf.cast(self.passes, v.dtype) for v in values]
            reduced = reduce(values)
            # Cleared by assignment, not by subtraction: an inf or nan in one cycle's sums
            # must not leak into the next.  The counter restarts, so that it always holds
            # the passes since the last combination (Horovod's ``_agg_helper.counter``).
            with tf.control_dependencies(reduced):
                clears = [s.assign(tf.zeros_like(s)) for s in self.sums]
                clears.append(self.counter.assign(0))
            with tf.control_dependencies(clears):
                return [tf.identity(r) for r in reduced]

        def keep():
            with tf.control_dependencies([count]):
                return [s.read_value() for s in self.sums]
        out = tf.cond(self.ready, reduce_and_clear, keep)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        result: List[Any] = list(grads)
        for i, value in zip(present, out):
            result[i] = value
        return result

    def apply(self, apply: Callable[[], Any], variables: Sequence[Any],
              skip: Optional[Callable[[], Any]] = None) -> Any:
        """``apply()`` on the passes that combined the gradients, else ``skip()`` if
        given."""
        def run():
            with tf.control_dependencies([apply()]):
                return tf.constant(True)

        def pass_():
            with tf.control_dependencies([skip()] if skip is not None else []):
                return tf.constant(False)
        with _v1_control_flow(any(getattr(v.dtype, "_is_ref_dtype", False)
                                  for v in variables)):
            applied = tf.cond(self.ready, run, pass_)
        return applied if tf.executing_eagerly() else applied.op


@contextlib.contextmanager
def _v1_control_flow(refs: bool):
    """TF1 control flow for a ``tf.cond`` whose branch updates RefVariables, in a graph
    built with TF2 behaviour otherwise (a ``cond_v2`` branch sees a RefVariable as a plain
    tensor and cannot assign to it).  TF1 programs that disable the v2 behaviour already
    have it."""
    graph = tf_ops.get_default_graph()
    if not refs or tf.executing_eagerly() or getattr(graph, "building_function", False):
        yield
        return
    saved = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        yield
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = saved


class _DistributedOptimizer(_LegacyOptimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` returns gradients
    combined over the ranks; everything else goes to the wrapped optimizer."""

    def __init__(self, optimizer: _LegacyOptimizer, name: Optional[str], use_locking: bool,
                 device_dense: str, device_sparse: str, compression: Type[Compressor],
                 sparse_as_dense: bool, op: int, gradient_predivide_factor: float, groups,
                 process_set: ProcessSet, backward_passes_per_step: int,
                 average_aggregated_gradients: bool):
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._options = dict(device_dense=device_dense, device_sparse=device_sparse,
                             compression=compression, sparse_as_dense=sparse_as_dense,
                             op=op, gradient_predivide_factor=gradient_predivide_factor,
                             groups=groups, process_set=process_set)
        self._aggregation = (_LocalAggregation(backward_passes_per_step,
                                               average_aggregated_gradients)
                             if backward_passes_per_step > 1 else None)

    def _reduce(self, grads: List[Any], variables: List[tf.Variable]) -> List[Any]:
        with tf.name_scope(self._name + "_Allreduce"):
            return allreduce_gradients(grads, variables, **self._options)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients combined over
        the process set (every N-th pass with ``backward_passes_per_step`` = N; the local
        sums otherwise)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = [list(x) for x in zip(*pairs)]
        if self._aggregation is None:
            reduced = self._reduce(grads, variables)
        else:
            present = [v for g, v in zip(grads, variables) if g is not None]
            reduced = self._aggregation.compute(
                grads, variables, lambda values: self._reduce(values, present))
        return list(zip(reduced, variables))

    def apply_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``apply_gradients`` (only on the passes that reduce, with
        ``backward_passes_per_step`` > 1)."""
        if self._aggregation is None:
            return self._optimizer.apply_gradients(*args, **kwargs)
        kwargs = dict(kwargs)
        pairs = list(args[0] if args else kwargs.pop("grads_and_vars"))
        rest = args[1:]
        return self._aggregation.apply(
            lambda: self._optimizer.apply_gradients(pairs, *rest, **kwargs),
            [v for _, v in pairs])

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = '', device_sparse: str = '',
                         compression: Type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True):
    """Wrap an optimizer so that gradients are combined over the ranks (averaged by default)
    before they are applied.

    A ``tf.compat.v1.train.Optimizer`` is wrapped here: ``compute_gradients`` returns the
    combined gradients and ``apply_gradients`` applies them (``minimize`` does both).  A
    Keras optimizer goes to ``aiak_training.tensorflow.keras.DistributedOptimizer`` with the
    same options (once that frontend is imported).  ``backward_passes_per_step`` > 1 sums
    gradients locally and combines and applies them every that many passes (divided by the
    count with ``average_aggregated_gradients``); its sums are local variables, which
    ``tf.compat.v1.local_variables_initializer()`` (or a ``MonitoredTrainingSession``)
    initializes.
    """
    groups = check_gradient_options(op, gradient_predivide_factor, num_groups, groups)
    if backward_passes_per_step <= 0:
        raise ValueError(hs.BACKWARD_PASSES_POSITIVE)
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if isinstance(optimizer, _LegacyOptimizer):
        if op == Adasum:
            # The delta optimizer (adasum_optimizer.py): updates are combined, not gradients.
            from aiak_training.tensorflow.adasum_optimizer import DistributedAdasumOptimizer
            return DistributedAdasumOptimizer(optimizer, name, use_locking, device_dense,
                                              device_sparse, compression,
                                              backward_passes_per_step)
        return _DistributedOptimizer(optimizer, name, use_locking, device_dense,
                                     device_sparse, compression, sparse_as_dense, op,
                                     gradient_predivide_factor, groups, process_set,
                                     backward_passes_per_step, average_aggregated_gradients)
    if _keras_wrapper is None:
        if type(optimizer).__module__.split(".")[0] in ("keras", "tf_keras"):
            raise ValueError(
                f"hvd.DistributedOptimizer got a Keras optimizer ({type(optimizer).__name__}) "
                "before aiak_training's Keras frontend was imported: import "
                "aiak_training.tensorflow.keras (horovod.tensorflow.keras) and use its "
                "DistributedOptimizer, or import it before this call.")
        raise ValueError("Provided optimizer doesn't inherit from either legacy TensorFlow or "
                         f"Keras optimizer: {optimizer}")
    if op == Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    return _keras_wrapper(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
