"""What Horovod's Keras callbacks do, for both Kerases: the learning-rate schedule and
warmup, and the averaging of the logs over the ranks.

Keras 3 (``aiak_training.keras.callbacks``) and Keras 2 (``aiak_training.keras.legacy``)
each need callbacks built on their own ``Callback`` class, but what the callbacks do is the
same.  The mixins hold the schedules; each Keras's callback class lists one of them before
its ``Callback`` base and says how to read a learning rate (``_read_value``) and, for the
warmup, how many ranks there are and which one this is (``_world_size``, ``_world_rank``).
:func:`average_logs` is ``MetricAverageCallback``'s work, given each Keras's allreduce.
No Keras is imported here.
"""
from typing import Any, Callable, Dict, Optional, Union

import numpy as np

from aiak_training.common import horovod_strings as hs


def average_logs(logs: Optional[Dict[str, Any]], as_numpy: Callable[[Any], Any],
                 allreduce_average: Callable[[np.ndarray], np.ndarray]) -> None:
    """Replace each entry of ``logs`` by its average over the ranks, in place: all entries
    in one float64 ``allreduce_average`` of their concatenation, in sorted order of their
    names (every rank must log the same names).  ``as_numpy`` reads one entry."""
    if not logs:
        return
    names = sorted(logs)
    values = [np.asarray(as_numpy(logs[n]), dtype=np.float64) for n in names]
    flat = np.concatenate([v.reshape(-1) for v in values])
    averaged = allreduce_average(flat)
    start = 0
    for name, value in zip(names, values):
        part = averaged[start:start + value.size].reshape(value.shape)
        start += value.size
        logs[name] = float(part) if value.ndim == 0 else part


class ScheduleMixin:
    """``lr = initial_lr * multiplier(epoch)`` for the epochs in ``[start_epoch, end_epoch)``
    (see ``LearningRateScheduleCallback``)."""

    # A learning rate or momentum as a Python float (set by each Keras's callback class).
    _read_value: Callable[[Any], float]

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
        old_lr = self._read_value(optimizer.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and hasattr(optimizer, "momentum"):
            self.restore_momentum = self._read_value(optimizer.momentum)
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
            logs["lr"] = self._read_value(self.model.optimizer.learning_rate)


class WarmupMixin(ScheduleMixin):
    """The linear warmup from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``
    (see ``LearningRateWarmupCallback``)."""

    # The number of ranks and this process's rank (set by each Keras's callback class).
    _world_size: Callable[[], int]
    _world_rank: Callable[[], int]

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch
            ranks = self._world_size()
            return 1.0 / ranks * (epoch * (ranks - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and self._world_rank() == 0:
            print(hs.WARMUP_FINISHED.format(
                epoch + 1, self._read_value(self.model.optimizer.learning_rate)))
