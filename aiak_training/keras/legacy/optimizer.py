"""``DistributedOptimizer`` and ``PartialDistributedOptimizer`` for Keras 2 (``tf_keras``):
its optimizers (``keras.optimizers.*``, Keras >= 2.11) and the legacy ones
(``keras.optimizers.legacy.*``, ``OptimizerV2``).

Where it hooks in, as Horovod's Keras 2 wrapper does: where the optimizer computes
gradients.  ``model.fit`` and ``optimizer.minimize`` go through ``compute_gradients``
(Keras 2.11+ optimizers) or ``_compute_gradients`` (legacy ones), and Keras 2's graph-mode
path through ``get_gradients``; each returns the gradients combined over the ranks.  Both
``compute_gradients`` and ``_compute_gradients`` answer on both families, since code written
for Horovod calls ``_compute_gradients`` whatever the optimizer.
``apply_gradients`` applies what it is given, so a custom loop that takes gradients from a
plain ``tf.GradientTape`` combines them itself (``hvd.DistributedGradientTape``), as with
Horovod.

The result is an instance of a subclass of the optimizer's own class, with its name, made
from its config; Keras saves it under that class, so a saved model loads without
aiak_training.  ``backward_passes_per_step`` > 1 sums gradients locally and combines and
applies them every that many passes (``iterations`` counts every pass), as Horovod does;
``optimizer._agg_helper.counter`` counts the passes since the last combination.
"""
from typing import Any, Dict, List, Optional

import tensorflow as tf

from aiak_training.common import horovod_strings as hs
from aiak_training.keras import _flavour
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.tensorflow.compression import Compression
from aiak_training.tensorflow.gradients import (allreduce_gradients, check_gradient_options,
                                                divide_gradient)
from aiak_training.tensorflow.mpi_ops import Average, Sum
from aiak_training.tensorflow.tf1 import _LocalAggregation

keras = _flavour.legacy()


class _Options(_flavour.WrapperState):
    """The shared state (variables told apart by ``ref()``), and the local sums of
    ``backward_passes_per_step`` > 1."""

    def __init__(self, scope: str, reduce_options: Dict[str, Any], process_set: ProcessSet,
                 scale_local_gradients: bool, aggregation: Optional[_LocalAggregation]):
        super().__init__(scope, reduce_options, process_set, scale_local_gradients,
                         lambda v: v.ref())
        self.aggregation = aggregation


class _Distributed:
    """What ``DistributedOptimizer`` adds to the Keras 2 optimizer class it wraps."""

    _aiak: _Options

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (divided by the process set's size when
        ``scale_local_gradients``)."""
        self._aiak.local.add(var)

    def _aiak_reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        state = self._aiak

        def reduce(shared: List[Any], where: List[Any]) -> List[Any]:
            with tf.name_scope(state.scope):
                return allreduce_gradients(shared, where, **state.reduce_options)
        return state.local.combine(grads, variables, reduce, divide_gradient,
                                   state.process_set.size)

    def _aiak_combine(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        aggregation = self._aiak.aggregation
        if aggregation is None:
            return self._aiak_reduce(grads, variables)
        if not self._aiak.reduce_options["sparse_as_dense"] and any(
                isinstance(g, tf.IndexedSlices) for g in grads):
            raise ValueError(hs.SPARSE_WITH_BACKWARD_PASSES)
        present = [v for g, v in zip(grads, variables) if g is not None]
        return aggregation.compute(grads, variables,
                                   lambda values: self._aiak_reduce(values, present))

    def _aiak_local_pairs(self, loss, var_list, grad_loss, tape) -> List[Any]:
        """This rank's ``(gradient, variable)`` pairs, from the wrapped family's own method:
        ``_compute_gradients`` for the legacy optimizers, ``compute_gradients`` for the
        current ones (which has no ``grad_loss`` and does not flatten ``var_list``)."""
        base = super()
        if hasattr(base, "_compute_gradients"):
            return base._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        if grad_loss is not None:
            raise ValueError(
                "grad_loss is an argument of the legacy optimizers' _compute_gradients; "
                f"{type(self).__name__} of tf_keras.optimizers has none: scale the loss "
                "instead, or use tf_keras.optimizers.legacy.")
        if not callable(var_list):
            var_list = tf.nest.flatten(var_list)
        return base.compute_gradients(loss, var_list, tape=tape)

    def _aiak_combined_pairs(self, loss, var_list, grad_loss, tape) -> List[Any]:
        pairs = self._aiak_local_pairs(loss, var_list, grad_loss, tape)
        grads, variables = [list(x) for x in zip(*pairs)] if pairs else ([], [])
        return list(zip(self._aiak_combine(grads, variables), variables))

    # Both names work with both families: Keras >= 2.11 optimizers call compute_gradients
    # (model.fit and minimize), the legacy ones _compute_gradients, and code written for
    # Horovod calls _compute_gradients on either.
    def compute_gradients(self, loss, var_list, tape=None):
        return self._aiak_combined_pairs(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        return self._aiak_combined_pairs(loss, var_list, grad_loss, tape)

    @property
    def _agg_helper(self) -> Optional[_LocalAggregation]:
        """Horovod's name for the local gradient sums of ``backward_passes_per_step`` > 1
        (None otherwise); its ``counter`` is the number of passes since they were last
        combined."""
        return self._aiak.aggregation

    # Legacy optimizers in Keras 2's graph mode.
    def get_gradients(self, loss, params):
        grads = super().get_gradients(loss, params)
        return self._aiak_combine(list(grads), list(params))

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        aggregation = self._aiak.aggregation
        if aggregation is None or aggregation.ready is None:
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        apply = super().apply_gradients
        # The passes in between still count in ``iterations``, as in Horovod.
        return aggregation.apply(lambda: apply(pairs, *args, **kwargs),
                                 [v for _, v in pairs],
                                 skip=lambda: self.iterations.assign_add(1))


_classes: Dict[type, type] = {}


def _distributed_class(base: type) -> type:
    """The subclass of ``base`` that combines gradients (one per class), saved under
    ``base``'s own module."""
    return _flavour.distributed_subclass(_classes, _Distributed, base, lambda cls: cls.__module__)


def _check_optimizer(optimizer: Any, what: str) -> None:
    if isinstance(optimizer, (keras.optimizers.Optimizer, keras.optimizers.legacy.Optimizer)):
        return
    if _flavour.keras_of(optimizer) is not None:
        raise _flavour.mixed_error(what, optimizer, keras)
    raise ValueError(f"{what} wraps a Keras 2 optimizer (tf_keras.optimizers.Optimizer or "
                     f"tf_keras.optimizers.legacy.Optimizer); got {type(optimizer).__name__}.")


def DistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = '',
                         device_sparse: str = '', compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Optional[Any] = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True):
    """Wrap a Keras 2 optimizer so that the gradients it computes are combined over the
    ranks (averaged by default); options as in Horovod's ``horovod.tensorflow.keras``.

    Returns a new optimizer of a subclass of ``type(optimizer)``, made from its config.
    """
    if op not in (Average, Sum):
        raise ValueError(hs.KERAS_OPS_SUPPORTED)
    groups = check_gradient_options(op, gradient_predivide_factor, num_groups, groups)
    if backward_passes_per_step <= 0:
        raise ValueError(hs.BACKWARD_PASSES_POSITIVE)
    _check_optimizer(optimizer, "DistributedOptimizer")
    cls = _distributed_class(type(optimizer))
    wrapped = cls.from_config(optimizer.get_config())
    aggregation = (_LocalAggregation(backward_passes_per_step, average_aggregated_gradients)
                   if backward_passes_per_step > 1 else None)
    options = _Options(name or f"Distributed{cls.__name__}",
                       dict(device_dense=device_dense, device_sparse=device_sparse,
                            compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                            gradient_predivide_factor=gradient_predivide_factor,
                            groups=groups, process_set=process_set),
                       process_set, scale_local_gradients, aggregation)
    object.__setattr__(wrapped, "_aiak", options)  # out of Keras's attribute tracking
    return wrapped


def PartialDistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = '',
                                device_sparse: str = '', compression: Any = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                groups: Optional[Any] = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers=None, scale_local_gradients: bool = True):
    """:func:`DistributedOptimizer` whose ``local_layers`` (a Keras 2 layer or a list of
    them) keep their trainable weights' gradients on each rank."""
    # Every other argument goes to DistributedOptimizer under its own name.
    options = {k: v for k, v in locals().items() if k not in ("optimizer", "local_layers")}
    return _flavour.partial_optimizer(DistributedOptimizer, keras, optimizer, local_layers,
                                      options)
