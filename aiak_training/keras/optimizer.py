"""``DistributedOptimizer`` for Keras 3: any Keras optimizer, with gradients combined over
the ranks before they are applied; and ``PartialDistributedOptimizer`` (``horovod.keras`` and
``horovod.tensorflow.keras`` have it), whose local layers keep their gradients on each rank.

Where it hooks in.  Every update of a Keras 3 optimizer goes through
``BaseOptimizer.apply(grads, trainable_variables)``: ``model.fit``'s train step calls
``apply_gradients`` on the TensorFlow backend (which calls ``apply``) and ``apply`` itself on
the torch backend, and custom loops call either.  The wrapper overrides ``apply``: it
reduces the gradients with the backend's collectives (a graph op inside the TensorFlow
train step's ``tf.function``, an eager call on torch) and passes the result on to the
wrapped class's ``apply``, which unscales, clips, decays and updates as usual.  Clipping
therefore sees the combined gradients.

The result is built as Horovod builds it: an instance of a subclass of the optimizer's own
class (so ``isinstance`` holds), named like it and created from its config.  Keras saves it
under that class name, so a saved model loads with plain Keras too; ``load_model`` of this
package wraps the loaded optimizer again.

Momentum that can change.  Keras 3 keeps ``momentum`` as a Python float, which a compiled
TensorFlow step takes in as a constant when it is traced; the learning-rate callbacks'
momentum correction (Horovod's) changes it between batches.  On the TensorFlow backend the
wrapper therefore mirrors the float into a variable and lets the traced update read that
variable (``_tf_ops._LiveFloat``); on torch, steps run eagerly and read the float anyway.
"""
from typing import Any, Dict, List, Optional

import keras

from aiak_training.common import horovod_strings as hs
from aiak_training.common.grouping import fold_num_groups
from aiak_training.keras import _backend, _flavour
from aiak_training.keras._accumulation import Accumulation
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set

_ops = _backend.adapter()
Compression = _ops.Compression
Average, Sum = _ops.Average, _ops.Sum


class _State(_flavour.WrapperState):
    """The shared state (variables told apart by identity), and the local sums of
    ``backward_passes_per_step`` > 1."""

    def __init__(self, scope: str, reduce_options: Dict[str, Any], process_set: ProcessSet,
                 scale_local_gradients: bool, accumulation: Optional[Accumulation]):
        super().__init__(scope, reduce_options, process_set, scale_local_gradients, id)
        self.accumulation = accumulation
        # TensorFlow backend: the variable that a compiled step reads the momentum from.
        self.momentum: Optional[keras.Variable] = None


class _CallableList(list):
    """A list that returns itself when called: Keras 2 code (Horovod's own callbacks
    among it) calls ``optimizer.variables()``, Keras 3 reads ``optimizer.variables``."""

    def __call__(self) -> "_CallableList":
        return self


class _Distributed:
    """What ``DistributedOptimizer`` adds to the class of the optimizer it wraps."""

    _aiak: _State

    @property
    def variables(self):
        return _CallableList(super().variables)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        state = self.__dict__.get("_aiak")
        if name == "momentum" and state is not None and state.momentum is not None:
            state.momentum.assign(float(value))

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        state = getattr(self, "_aiak", None)
        if state is None or state.momentum is None:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        # While the update is traced, `momentum` reads the live variable (see _State).
        plain = self.__dict__["momentum"]
        object.__setattr__(self, "momentum", _ops.live_float(plain, state.momentum))
        try:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        finally:
            object.__setattr__(self, "momentum", plain)

    def build(self, variables):
        super().build(variables)
        state = getattr(self, "_aiak", None)  # None while DistributedOptimizer creates it
        if state is not None and state.accumulation is not None:
            state.accumulation.build(variables)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank: it is not combined with the others' (and
        is divided by the process set's size when ``scale_local_gradients``)."""
        self._aiak.local.add(var)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads or (trainable_variables is None and not self.built):
            return super().apply(grads, trainable_variables)  # Keras's no-op / its error
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        accumulation = self._aiak.accumulation
        if accumulation is None:
            return super().apply(self._aiak_reduce(grads, variables), trainable_variables)
        if not self.built:
            # The sums must exist before the graph branches on them.
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        accumulation.step(grads, variables, self._aiak_reduce,
                          lambda reduced: super(_Distributed, self).apply(
                              reduced, trainable_variables),
                          self._iterations)
        return None

    def _aiak_reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        """``grads`` combined over the process set, local variables' gradients excepted."""
        state = self._aiak
        return state.local.combine(
            grads, variables,
            lambda shared, where: _ops.reduce_gradients(shared, where, state.scope,
                                                        **state.reduce_options),
            _ops.divide_gradient, state.process_set.size)


_classes: Dict[type, type] = {}


def _saved_module(base: type) -> str:
    """The module Keras writes when it saves an instance of ``base``: ``keras.optimizers``
    for the classes exported there, else the class's own module (what
    ``keras.saving.serialize_keras_object`` does, without calling it: on the torch backend
    it imports TensorFlow)."""
    if getattr(keras.optimizers, base.__name__, None) is base:
        return "keras.optimizers"
    return base.__module__


def _distributed_class(optimizer: keras.optimizers.Optimizer) -> type:
    """The subclass of ``type(optimizer)`` that reduces gradients (one per class).

    It carries the class name and the module under which Keras saves the original, so a
    saved model names the plain optimizer and loads without aiak_training.
    """
    return _flavour.distributed_subclass(_classes, _Distributed, type(optimizer), _saved_module)


def _adopt_state(new: keras.optimizers.Optimizer, old: keras.optimizers.Optimizer) -> None:
    """Give ``new`` the variables and values of ``old`` if ``old`` is built (iterations,
    learning rate, slots), so wrapping a trained or loaded optimizer loses nothing."""
    if not old.built:
        return
    new.build(list(old._trainable_variables))
    if len(new.variables) != len(old.variables):
        raise ValueError(f"cannot carry the state of {old.name} over to its distributed copy: "
                         f"{len(old.variables)} variables against {len(new.variables)}.")
    for target, source in zip(new.variables, old.variables):
        target.assign(source)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                         device_dense: str = '', device_sparse: str = '',
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: int = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Optional[Any] = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that gradients are combined over the ranks (averaged by
    default) before every update.

    Arguments:
        optimizer: any ``keras.optimizers.Optimizer`` (built or not; a built one's state is
            carried over).
        name: prefix of the collective operations' names; default ``"Distributed"`` plus
            the optimizer's class name.  The optimizer's own ``name`` is kept.
        device_dense, device_sparse: devices for the TensorFlow ops around the reductions.
        compression: ``Compression.none`` or ``Compression.fp16`` (on the wire only).
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        op: ``Average`` or ``Sum``.
        backward_passes_per_step: apply once every this many calls of ``apply``, with the
            gradients summed locally in between (``iterations`` still counts every call).
        average_aggregated_gradients: divide those sums by ``backward_passes_per_step``.
        num_groups: deprecated form of an integer ``groups``.
        groups: None (one operation for all gradients), a number of operations, or lists of
            variables whose gradients travel together.
        process_set: the ranks to combine over.
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` by the set size.

    Returns:
        A new optimizer, an instance of a subclass of ``type(optimizer)``.
    """
    if op not in (Average, Sum):
        raise ValueError(hs.KERAS_OPS_SUPPORTED)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(hs.PREDIVIDE_NEEDS_AVERAGE)
    if backward_passes_per_step <= 0:
        raise ValueError(hs.BACKWARD_PASSES_POSITIVE)
    if not isinstance(optimizer, keras.optimizers.Optimizer) and \
            _flavour.keras_of(optimizer) == "tf_keras":
        raise _flavour.mixed_error("DistributedOptimizer", optimizer, keras)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer wraps a Keras 3 optimizer "
                         f"(keras.optimizers.Optimizer); got {type(optimizer).__name__}.")
    groups = fold_num_groups(num_groups, groups)
    cls = _distributed_class(optimizer)
    wrapped = cls.from_config(optimizer.get_config())
    accumulation = (Accumulation(backward_passes_per_step, average_aggregated_gradients,
                                 sparse_as_dense, _ops)
                    if backward_passes_per_step > 1 else None)
    state = _State(name or f"Distributed{cls.__name__}",
                   dict(device_dense=device_dense, device_sparse=device_sparse,
                        compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                        gradient_predivide_factor=gradient_predivide_factor, groups=groups,
                        process_set=process_set),
                   process_set, scale_local_gradients, accumulation)
    if _ops.LIVE_HYPERPARAMETERS and isinstance(getattr(wrapped, "momentum", None), float):
        state.momentum = keras.Variable(wrapped.momentum, dtype="float64", trainable=False,
                                        name="aiak_momentum")
    # object.__setattr__ keeps Keras's (and TensorFlow's) attribute tracking out of it.
    object.__setattr__(wrapped, "_aiak", state)
    _adopt_state(wrapped, optimizer)
    return wrapped


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                                device_dense: str = '', device_sparse: str = '',
                                compression: Any = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                groups: Optional[Any] = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers=None,
                                scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """:func:`DistributedOptimizer` whose ``local_layers`` (a Keras layer or a list of them)
    keep their trainable weights' gradients local: not combined over the ranks, and divided
    by the process set's size when ``scale_local_gradients``."""
    # Every other argument goes to DistributedOptimizer under its own name.
    options = {k: v for k, v in locals().items() if k not in ("optimizer", "local_layers")}
    return _flavour.partial_optimizer(DistributedOptimizer, keras, optimizer, local_layers,
                                      options)


def is_distributed(optimizer: Any) -> bool:
    """Whether ``optimizer`` came from :func:`DistributedOptimizer`."""
    return isinstance(optimizer, _Distributed)

