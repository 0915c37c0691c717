"""Horovod's Keras callbacks for Keras 2 (``tf_keras``): ``BroadcastGlobalVariablesCallback``,
``MetricAverageCallback``, ``LearningRateScheduleCallback``, ``LearningRateWarmupCallback``.

Same behaviour as the Keras 3 ones (``aiak_training.keras.callbacks``), on Keras 2's
``Callback`` class, whose ``model.fit`` needs its own base class.  Learning rate and
momentum are set through the optimizer's attributes, which Keras 2 optimizers keep in
variables (a compiled step reads their current value), except a Keras >= 2.11 optimizer's
``momentum``, a Python float taken in when the step is traced, as with Horovod.
"""
from typing import Any, Dict, Optional

import tensorflow as tf

from aiak_training.common import horovod_strings as hs
from aiak_training.keras import _flavour, _callbacks_shared
from aiak_training.tensorflow import functions, reductions
from aiak_training.tensorflow.mpi_ops import Average, rank, size

keras = _flavour.legacy()


def _optimizer_variables(optimizer) -> list:
    # Legacy optimizers have variables(), Keras >= 2.11 ones a variables property.
    found = optimizer.variables
    return list(found() if callable(found) else found)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's variables and then its optimizer's from ``root_rank`` at the
    end of the first batch (when the optimizer has its slots), once.  Variables given in
    ``local_variables`` or registered with ``register_local_var`` keep each rank's value."""

    def __init__(self, root_rank: int, device: str = '', local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars: set = set()
        for var in ([local_variables] if isinstance(local_variables, tf.Variable)
                    else list(local_variables or [])):
            if not isinstance(var, tf.Variable):
                raise ValueError(hs.LOCAL_VARIABLES_TYPE)
            self.register_local_var(var)

    def register_local_var(self, var) -> None:
        """Leave ``var`` out of the broadcast."""
        self._local_vars.add(var.ref())

    def on_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.broadcast_done:
            return
        with tf.device(self.device):
            weights = [v for v in self.model.variables if v.ref() not in self._local_vars]
            functions.broadcast_variables(weights, self.root_rank)
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None:
                state = [v for v in _optimizer_variables(optimizer)
                         if v.ref() not in self._local_vars]
                functions.broadcast_variables(state, self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's logs with their average over the ranks at the end of the
    epoch (put it before callbacks that read them); one float64 allreduce, names in sorted
    order."""

    def __init__(self, device: str = ''):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        _callbacks_shared.average_logs(
            logs, lambda value: value,
            lambda flat: reductions.allreduce(tf.constant(flat), name="MetricAverageCallback",
                                              op=Average).numpy())


def _get_value(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return float(keras.backend.get_value(value))


class LearningRateScheduleCallback(_callbacks_shared.ScheduleMixin, keras.callbacks.Callback):
    """Learning rate ``initial_lr * multiplier(epoch)`` for the epochs in
    ``[start_epoch, end_epoch)`` (``multiplier`` a function, or a number ``m`` meaning
    ``m ** (epoch - start_epoch)``); per epoch with ``staircase``, else per batch with a
    fractional epoch.  ``momentum_correction`` scales momentum by ``new_lr / old_lr`` for
    the batch where the rate changes.  The rate is logged as ``lr`` at each epoch's end."""

    _read_value = staticmethod(_get_value)


class LearningRateWarmupCallback(_callbacks_shared.WarmupMixin, LearningRateScheduleCallback):
    """Raise the learning rate linearly from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, batch by batch:
    ``lr(epoch) = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)``, with the
    fractional epoch shifted by one batch.  ``verbose`` > 0: rank 0 prints the final rate."""

    _world_size = staticmethod(size)
    _world_rank = staticmethod(rank)


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]
