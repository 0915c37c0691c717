"""``import aiak_training.keras as hvd``: Horovod's Keras API for Keras 3, on the
TensorFlow or the torch backend (whichever this process's Keras runs on).

``aiak_training.tensorflow.keras`` is the same API under the name of
``horovod.tensorflow.keras``.  What is here: the basics (``init``, ``rank``, ``size``, ...),
process sets, ``Average``/``Sum``, ``Compression``; ``DistributedOptimizer`` (any Keras 3
optimizer); ``allreduce``, ``allgather``, ``broadcast``, ``reducescatter`` of values;
``broadcast_global_variables``; ``load_model``; and the ``callbacks`` module.
"""
from aiak_training.common.exceptions import HorovodInternalError  # noqa: F401
from aiak_training.keras import _backend
from aiak_training.keras import callbacks  # noqa: F401
from aiak_training.keras.optimizer import DistributedOptimizer  # noqa: F401
from aiak_training.keras.saving import load_model  # noqa: F401
from aiak_training.keras.values import (allgather, allreduce, broadcast,  # noqa: F401
                                        reducescatter)
from aiak_training.keras.variables import broadcast_global_variables  # noqa: F401
from aiak_training.runtime.basics import add_process_set, remove_process_set  # noqa: F401
from aiak_training.runtime.process_sets import ProcessSet, global_process_set  # noqa: F401

_ops = _backend.adapter()
# The basics come from the backend's frontend, whose init also resets its own state.
init, shutdown, is_initialized = _ops.init, _ops.shutdown, _ops.is_initialized
size, local_size, cross_size = _ops.size, _ops.local_size, _ops.cross_size
rank, local_rank, cross_rank = _ops.rank, _ops.local_rank, _ops.cross_rank
start_timeline, stop_timeline = _ops.start_timeline, _ops.stop_timeline
mpi_threads_supported, mpi_enabled, mpi_built = (_ops.mpi_threads_supported, _ops.mpi_enabled,
                                                 _ops.mpi_built)
gloo_enabled, gloo_built = _ops.gloo_enabled, _ops.gloo_built
nccl_built, ddl_built, ccl_built = _ops.nccl_built, _ops.ddl_built, _ops.ccl_built
cuda_built, rocm_built = _ops.cuda_built, _ops.rocm_built
Average, Sum, Adasum = _ops.Average, _ops.Sum, _ops.Adasum
Compression = _ops.Compression
