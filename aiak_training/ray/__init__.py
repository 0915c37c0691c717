"""aiak_training on Ray: ``RayExecutor`` with Horovod 0.28.1's ``horovod.ray`` API.

Needs the ``ray`` extra (``pip install aiak-training[ray]``).  The workers are Ray actors and
talk over aiak_training's Gloo mode; see docs/ray.md.
"""
try:
    import ray as _ray  # noqa: F401 - only to fail early with the extra's name
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise ImportError("aiak_training.ray needs Ray, which is not installed: "
                      "pip install 'aiak-training[ray]' (Ray 2.60)") from _exc

from aiak_training.ray.runner import MiniSettings, RayExecutor, RayWorkerError
from aiak_training.ray.worker import BaseHorovodWorker


class ElasticRayExecutor:
    """Horovod's elastic Ray executor: not available until aiak_training has elastic training."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "ElasticRayExecutor needs aiak_training's elastic training (hvd.elastic with Gloo "
            "worlds that re-form when workers come and go), which is not available yet; use "
            "RayExecutor(num_workers=...) for a fixed-size job.")

    @staticmethod
    def create_settings(*args, **kwargs):
        raise NotImplementedError("ElasticRayExecutor is not available yet (no elastic "
                                  "training in aiak_training); use RayExecutor.create_settings.")


__all__ = ["RayExecutor", "BaseHorovodWorker", "ElasticRayExecutor", "MiniSettings",
           "RayWorkerError"]
