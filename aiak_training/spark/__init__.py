"""aiak_training inside Spark: ``run`` with Horovod 0.28.1's ``horovod.spark.run`` API.

Needs the ``spark`` extra (``pip install aiak-training[spark]``).  The ranks run in Spark
tasks (barrier execution mode) and talk over aiak_training's Gloo mode; see docs/spark.md.
"""
try:
    import pyspark as _pyspark  # noqa: F401 - only to fail early with the extra's name
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise ImportError("aiak_training.spark needs pyspark, which is not installed: "
                      "pip install 'aiak-training[spark]' (pyspark 4.3)") from _exc

from aiak_training.spark.elastic import ElasticJobError, run_elastic
from aiak_training.spark.runner import SparkRankError, run

__all__ = ["run", "run_elastic", "SparkRankError", "ElasticJobError"]
