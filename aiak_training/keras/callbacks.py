"""Keras callbacks for distributed training (``hvd.callbacks``), with Horovod's timing:

* ``BroadcastGlobalVariablesCallback``: root's model weights and optimizer variables to
  every rank, once, at the end of the first batch;
* ``MetricAverageCallback``: every epoch's logs averaged over the ranks at epoch end;
* ``LearningRateScheduleCallback``: ``lr = initial_lr * multiplier(epoch)`` at the start of
  each epoch (staircase) or batch;
* ``LearningRateWarmupCallback``: the linear warmup from ``initial_lr / size`` to
  ``initial_lr`` over the first epochs.

Learning rates are read and written through ``optimizer.learning_rate``.  Momentum
correction scales ``optimizer.momentum`` (a float in Keras 3) by ``new_lr / old_lr`` for
the batch in which the rate changed, and puts it back at the batch's end; see
``aiak_training.keras.optimizer`` for how the change reaches a compiled TensorFlow step.
"""
from typing import Any, Dict, Optional

import keras

from aiak_training.common import horovod_strings as hs
from aiak_training.keras import _backend, _callbacks_shared
from aiak_training.runtime.diagnostics.call_origin import collective_helper
from aiak_training.runtime.sets.process_sets import global_process_set

_ops = _backend.adapter()


def _is_framework_variable(value: Any) -> bool:
    # A tf.Variable (TensorFlow backend), recognised without importing TensorFlow.
    return type(value).__module__.startswith("tensorflow") and hasattr(value, "assign")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from ``root_rank``'s state: at the end of the first batch the
    model's weights (``model.weights``, less the registered local variables) and then the
    optimizer's variables are overwritten with the root's.

    It waits for the first batch, as Horovod does, because only then are all optimizers'
    variables certain to exist; that batch's update is computed from each rank's own
    weights and then replaced by the root's.
    """

    def __init__(self, root_rank: int, device: str = '', local_variables: Any = None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device  # kept for compatibility; the data stays where Keras keeps it
        self.broadcast_done = False
        self._local_vars: set = set()
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, keras.Variable) or not hasattr(local_variables,
                                                                       "__iter__"):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        if not all(isinstance(v, keras.Variable) or _is_framework_variable(v)
                   for v in local_variables):
            raise ValueError(hs.LOCAL_VARIABLES_TYPE)
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast (it keeps each rank's own value)."""
        self._local_vars.add(id(var))

    @collective_helper("BroadcastGlobalVariablesCallback")
    def on_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.broadcast_done:
            return
        # A local variable may have been given as the Keras variable or as the framework
        # variable under it (``v.value``).
        weights = [v for v in self.model.weights
                   if id(v) not in self._local_vars and id(v.value) not in self._local_vars]
        _ops.broadcast_variables(weights, self.root_rank, global_process_set)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            _ops.broadcast_variables(list(optimizer.variables), self.root_rank,
                                     global_process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's logs (loss, metrics, validation metrics) with their average
    over the ranks, at the end of the epoch, so that callbacks after it (put it first),
    such as ``ReduceLROnPlateau``, ``EarlyStopping`` or checkpointing, see the same values
    on every rank.

    All entries travel in one float64 allreduce, in sorted order of their names (every rank
    must log the same names); Horovod reduces them in float32.
    """

    def __init__(self, device: str = ''):
        super().__init__()
        self.device = device  # kept for compatibility

    def _average_metrics_in_place(self, logs: Optional[Dict[str, Any]]) -> None:
        _callbacks_shared.average_logs(
            logs, keras.ops.convert_to_numpy,
            lambda flat: keras.ops.convert_to_numpy(
                _ops.frontend.allreduce(_ops.to_tensor(flat), name="MetricAverageCallback",
                                        op=_ops.Average)))

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._average_metrics_in_place(logs)


def _get_value(value: Any) -> float:
    # A Python number as it is (through a tensor it would be rounded to float32).
    if isinstance(value, (int, float)):
        return float(value)
    return float(keras.ops.convert_to_numpy(value))


class LearningRateScheduleCallback(_callbacks_shared.ScheduleMixin, keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` for the epochs in
    ``[start_epoch, end_epoch)``.

    ``multiplier`` is a function of the epoch, or a number ``m`` meaning
    ``m ** (epoch - start_epoch)``.  With ``staircase`` the rate changes at the first batch
    of each epoch, with the whole epoch number; otherwise at every batch, with
    ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` is taken from ``fit``'s
    parameters when not given).  ``momentum_correction`` scales the optimizer's momentum by
    ``new_lr / old_lr`` for the batch in which the rate changes.  At each epoch's end the
    rate is logged as ``lr``.
    """

    _read_value = staticmethod(_get_value)


class LearningRateWarmupCallback(_callbacks_shared.WarmupMixin, LearningRateScheduleCallback):
    """Raise the learning rate linearly from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, batch by batch (Goyal et al., "Accurate, Large Minibatch SGD").

    With ``epoch`` counted in fractions of an epoch (``epoch + batch / steps_per_epoch``)
    and shifted by one batch, so that each epoch ends on a round value::

        lr(epoch) = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)

    ``verbose`` > 0 makes rank 0 print the final rate when the warmup ends.
    """

    _world_size = staticmethod(lambda: _ops.size())
    _world_rank = staticmethod(lambda: _ops.rank())
