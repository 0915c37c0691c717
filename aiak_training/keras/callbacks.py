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
from typing import Any, Callable, Dict, Optional, Union

import keras
import numpy as np

from aiak_training.common import horovod_strings as hs
from aiak_training.keras import _backend
from aiak_training.runtime.process_sets import global_process_set

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
        if not logs:
            return
        names = sorted(logs)
        values = [np.asarray(keras.ops.convert_to_numpy(logs[n]), dtype=np.float64)
                  for n in names]
        flat = np.concatenate([v.reshape(-1) for v in values])
        averaged = keras.ops.convert_to_numpy(
            _ops.frontend.allreduce(_ops.to_tensor(flat), name="MetricAverageCallback",
                                    op=_ops.Average))
        start = 0
        for name, value in zip(names, values):
            part = averaged[start:start + value.size].reshape(value.shape)
            start += value.size
            logs[name] = float(part) if value.ndim == 0 else part

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._average_metrics_in_place(logs)


def _get_value(value: Any) -> float:
    # A Python number as it is (through a tensor it would be rounded to float32).
    if isinstance(value, (int, float)):
        return float(value)
    return float(keras.ops.convert_to_numpy(value))


class LearningRateScheduleCallback(keras.callbacks.Callback):
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

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None,
                 staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError(hs.INITIAL_LR_REQUIRED)
        self.initial_lr, self.steps_per_epoch = initial_lr, steps_per_epoch
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        # A number means exponential decay from start_epoch on.
        self.multiplier = (multiplier if callable(multiplier)
                           else lambda epoch: multiplier ** (epoch - start_epoch))
        self.restore_momentum: Optional[float] = None  # set while a batch runs corrected
        self.current_epoch: Optional[int] = None

    def _autodetect_steps_per_epoch(self) -> int:
        if self.params.get("steps"):
            return self.params["steps"]
        if self.params.get("samples") and self.params.get("batch_size"):
            return self.params["samples"] // self.params["batch_size"]
        raise ValueError(hs.STEPS_PER_EPOCH_UNKNOWN.format(type(self).__name__))

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _get_value(optimizer.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and hasattr(optimizer, "momentum"):
            self.restore_momentum = _get_value(optimizer.momentum)
            optimizer.momentum = self.restore_momentum * new_lr / old_lr

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum:
            self.model.optimizer.momentum = self.restore_momentum
            self.restore_momentum = None

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.current_epoch < self.start_epoch or (
                self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(self.current_epoch)
        else:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is not None:
            logs["lr"] = _get_value(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raise the learning rate linearly from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, batch by batch (Goyal et al., "Accurate, Large Minibatch SGD").

    With ``epoch`` counted in fractions of an epoch (``epoch + batch / steps_per_epoch``)
    and shifted by one batch, so that each epoch ends on a round value::

        lr(epoch) = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)

    ``verbose`` > 0 makes rank 0 print the final rate when the warmup ends.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch
            ranks = _ops.size()
            return 1.0 / ranks * (epoch * (ranks - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _ops.rank() == 0:
            print(hs.WARMUP_FINISHED.format(
                epoch + 1, _get_value(self.model.optimizer.learning_rate)))

