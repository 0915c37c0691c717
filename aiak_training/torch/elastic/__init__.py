"""``hvd.elastic`` for PyTorch (Horovod's ``horovod.torch.elastic``): ``run``, ``State``,
``ObjectState``, ``TorchState`` and ``ElasticSampler``."""
from typing import Any, Callable, Optional

from aiak_training.common.exceptions import (HorovodInternalError,  # noqa: F401
                                             HostsUpdatedInterrupt)
from aiak_training.elastic import ObjectState as _CoreObjectState
from aiak_training.elastic import State, run_fn  # noqa: F401
from aiak_training.elastic.worker import reset_world
from aiak_training.torch.elastic.sampler import ElasticSampler  # noqa: F401
from aiak_training.torch.elastic.state import TorchState  # noqa: F401


class ObjectState(_CoreObjectState):
    """State of picklable attributes: ``hvd.elastic.ObjectState(epoch=0, batch=0)``.

    ``bcast_object`` and ``get_rank`` (Horovod's common signature) default to this
    frontend's ``broadcast_object`` and ``rank``.
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any):
        from aiak_training.torch.functions import broadcast_object
        from aiak_training.torch.mpi_ops import rank
        if bcast_object is None:
            def bcast_object(obj: Any) -> Any:
                return broadcast_object(obj, root_rank=0, name="elastic.state")
        super().__init__(bcast_object=bcast_object, get_rank=get_rank or rank, **kwargs)


def _reset() -> None:
    from aiak_training.torch.mpi_ops import init, shutdown
    reset_world(shutdown, init)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for the training function ``func(state, ...)``: after a failure or a host
    change it is called again from the last ``state.commit()`` (see
    :func:`aiak_training.elastic.run_fn`)."""
    return run_fn(func, _reset)
