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
    """Horovod's older elastic Ray executor (deprecated there): use
    ``RayExecutor(settings, min_workers=..., max_workers=...)`` instead."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "ElasticRayExecutor (deprecated in Horovod) is not provided; use "
            "RayExecutor(settings, min_workers=..., max_workers=...), the elastic form of "
            "RayExecutor (docs/ray.md).")

    @staticmethod
    def create_settings(*args, **kwargs):
        raise NotImplementedError("ElasticRayExecutor is not provided; use "
                                  "RayExecutor.create_settings and RayExecutor(min_workers=...).")


__all__ = ["RayExecutor", "BaseHorovodWorker", "ElasticRayExecutor", "MiniSettings",
           "RayWorkerError"]
