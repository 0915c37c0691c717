"""``hvd.elastic`` for Keras 3 (Horovod's ``horovod.keras.elastic`` and
``horovod.tensorflow.keras.elastic``): ``run``, ``KerasState`` and the callbacks that commit
and track progress during ``model.fit``.  Works on the TensorFlow and the torch backend."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import keras

from aiak_training.common.exceptions import (HorovodInternalError,  # noqa: F401
                                             HostsUpdatedInterrupt)
from aiak_training.elastic import ObjectState as _CoreObjectState
from aiak_training.elastic import State, run_fn  # noqa: F401
from aiak_training.elastic.state import VariablesState
from aiak_training.elastic.worker import reset_world
from aiak_training.keras import _backend

_ops = _backend.adapter()


def _broadcast_object(obj: Any) -> Any:
    from aiak_training.runtime.arrays.objects import broadcast_object
    from aiak_training.runtime.sets.process_sets import global_process_set
    return broadcast_object(obj, 0, "elastic.state", global_process_set)


class ObjectState(_CoreObjectState):
    """State of picklable attributes (``bcast_object``/``get_rank`` default to this
    frontend's)."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any):
        super().__init__(bcast_object=bcast_object or _broadcast_object,
                         get_rank=get_rank or _ops.rank, **kwargs)


def _model_variables(model: Any, optimizer: Any) -> List[Any]:
    if optimizer is not None and not getattr(optimizer, "built", True):
        # A fresh rank's optimizer has no slots yet; build them so that every rank
        # broadcasts the same list of variables.
        optimizer.build(model.trainable_variables)
    return list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])


class TensorFlowKerasState(VariablesState):
    """Horovod's ``TensorFlowKerasState(model, optimizer=None, backend=None, **kwargs)``: the
    model's and optimizer's variables (copied at each commit, broadcast from rank 0 at sync)
    plus any picklable attributes.  ``backend`` is accepted and unused (Keras 3 runs
    eagerly outside its compiled steps)."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any):
        from aiak_training.runtime.sets.process_sets import global_process_set
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        self.backend = backend
        super().__init__(
            variables=lambda: _model_variables(self.model, self.optimizer),
            broadcast=lambda vs: _ops.broadcast_variables(vs, 0, process_set=global_process_set),
            bcast_object=_broadcast_object, get_rank=_ops.rank, **kwargs)


class KerasState(TensorFlowKerasState):
    """Horovod's ``hvd.elastic.KerasState(model, optimizer=None, **kwargs)``, e.g.
    ``KerasState(model, batch=0, epoch=0)``."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any):
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches of ``model.fit``."""

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        # Every rank starts counting afresh when fit (re)starts after a reset: a rank that
        # joined must commit at the same batch as those that were already training.
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of the last batch done in the current epoch (0 at
    each epoch's end); with ``steps_per_epoch`` the resumed epoch runs only the rest."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.steps_per_epoch: Optional[int] = None

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        params = self.params or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params.get("steps")
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs completed, counting from the epoch the
    current ``fit`` started at (``state.epoch`` when training began)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


def _reset() -> None:
    reset_world(_ops.shutdown, _ops.init)


def _as_internal_error(func: Callable[..., Any]) -> Callable[..., Any]:
    """TensorFlow reports a failed collective inside a compiled step as an ``OpError``
    carrying our message; make it the ``HorovodInternalError`` that ``run`` resets on."""
    if _backend.name() != "tensorflow":
        return func
    # Imported here: the torch backend must not load TensorFlow.
    from aiak_training.tensorflow.elastic import as_internal_error
    return as_internal_error(func)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for the training function ``func(state, ...)`` (see
    :func:`aiak_training.elastic.run_fn`)."""
    return run_fn(_as_internal_error(func), _reset)
