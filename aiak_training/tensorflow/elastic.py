"""``hvd.elastic`` for TensorFlow 2 (Horovod's ``horovod.tensorflow.elastic``): ``run``,
``ObjectState``, ``TensorFlowState`` (a list of variables) and ``TensorFlowKerasState``
(a Keras model and its optimizer)."""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from aiak_training.common.exceptions import (HorovodInternalError,  # noqa: F401
                                             HostsUpdatedInterrupt)
from aiak_training.elastic import ObjectState as _CoreObjectState
from aiak_training.elastic import State, run_fn  # noqa: F401
from aiak_training.elastic.state import VariablesState
from aiak_training.elastic.worker import reset_world


def _broadcast_object(obj: Any) -> Any:
    from aiak_training.tensorflow.functions import broadcast_object
    return broadcast_object(obj, root_rank=0, name="elastic.state")


def _rank() -> int:
    from aiak_training.tensorflow.mpi_ops import rank
    return rank()


class ObjectState(_CoreObjectState):
    """State of picklable attributes (``bcast_object``/``get_rank`` default to this
    frontend's)."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any):
        super().__init__(bcast_object=bcast_object or _broadcast_object,
                         get_rank=get_rank or _rank, **kwargs)


def _broadcast(variables: List[Any]) -> None:
    from aiak_training.tensorflow.functions import broadcast_variables
    broadcast_variables(variables, root_rank=0)


class TensorFlowState(VariablesState):
    """Horovod's ``TensorFlowState(variables=None, session=None, **kwargs)``: TensorFlow
    variables (copied at each commit, broadcast from rank 0 at sync) plus picklable
    attributes.  TensorFlow 2 runs eagerly, so ``variables`` must be given and ``session``
    is not used."""

    def __init__(self, variables: Optional[Sequence[tf.Variable]] = None, session: Any = None,
                 **kwargs: Any):
        if variables is None:
            raise ValueError("TensorFlowState needs variables= in TensorFlow 2 (there are no "
                             "global variables to default to in eager mode)")
        self.variables = list(variables)
        self.session = session
        super().__init__(variables=lambda: self.variables, broadcast=_broadcast,
                         bcast_object=_broadcast_object, get_rank=_rank, **kwargs)


class TensorFlowKerasState(VariablesState):
    """Horovod's ``TensorFlowKerasState(model, optimizer=None, backend=None, **kwargs)``: a
    Keras model's and optimizer's variables plus picklable attributes (``backend`` is
    accepted and unused: TensorFlow 2 runs eagerly)."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        self.backend = backend

        def variables() -> List[Any]:
            opt = self.optimizer
            if opt is not None and not getattr(opt, "built", True):
                opt.build(self.model.trainable_variables)  # same variables on every rank
            return list(self.model.variables) + (list(opt.variables) if opt is not None
                                                  else [])
        super().__init__(variables=variables, broadcast=_broadcast,
                         bcast_object=_broadcast_object, get_rank=_rank, **kwargs)


def _reset() -> None:
    from aiak_training.tensorflow.mpi_ops import init, shutdown
    reset_world(shutdown, init)


def as_internal_error(func: Callable[..., Any]) -> Callable[..., Any]:
    """A failed collective inside ``tf.function`` arrives as an ``OpError`` whose message
    carries ours: make it the ``HorovodInternalError`` that ``run`` resets on."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as exc:
            if isinstance(exc, HorovodInternalError) or "HorovodInternalError" not in str(exc):
                raise
            raise HorovodInternalError(str(exc)) from exc
    return wrapper


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for the training function ``func(state, ...)`` (see
    :func:`aiak_training.elastic.run_fn`)."""
    return run_fn(as_internal_error(func), _reset)

