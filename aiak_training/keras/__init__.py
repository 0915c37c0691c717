"""``import aiak_training.keras as hvd``: Horovod's Keras API for Keras 3, on the
TensorFlow or the torch backend (whichever this process's Keras runs on).

``aiak_training.tensorflow.keras`` is the same API under the name of
``horovod.tensorflow.keras``.  What is here: the basics (``init``, ``rank``, ``size``, ...),
process sets, ``Average``/``Sum``, ``Compression``; ``DistributedOptimizer`` (any Keras 3
optimizer); ``allreduce``, ``allgather``, ``broadcast``, ``reducescatter`` of values;
``broadcast_global_variables``; ``load_model``; and the ``callbacks`` module.

A process that trains with Keras 2 (``tf_keras`` with ``TF_USE_LEGACY_KERAS=1``, or
``keras`` 2.x) gets the Keras 2 versions of the optimizers, callbacks, ``load_model`` and
``broadcast_global_variables`` (``aiak_training.keras.legacy``) under the same names.
"""
from aiak_training.common.exceptions import HorovodInternalError  # noqa: F401
from aiak_training.keras import _backend
from aiak_training.keras import callbacks  # noqa: F401
from aiak_training.keras.optimizer import DistributedOptimizer  # noqa: F401
from aiak_training.keras.saving import load_model  # noqa: F401
from aiak_training.keras.collectives import (allgather, allreduce, broadcast,  # noqa: F401
                                             broadcast_global_variables, reducescatter)
from aiak_training.runtime.basics import add_process_set, remove_process_set  # noqa: F401
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set  # noqa: F401

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

from aiak_training.keras import _flavour  # noqa: E402
if _flavour.legacy() is None:
    from aiak_training.keras.optimizer import PartialDistributedOptimizer  # noqa: F401,E402
else:
    # Keras 2 (tf_keras): Horovod's Keras 2 optimizer, callbacks, loading and broadcast.
    from aiak_training.keras.legacy import (DistributedOptimizer,  # noqa: F401,E402,F811
                                            PartialDistributedOptimizer,
                                            broadcast_global_variables, callbacks, load_model)
if _backend.name() == "tensorflow":
    # hvd.DistributedOptimizer of aiak_training.tensorflow hands Keras optimizers to this one.
    from aiak_training.tensorflow import tf1 as _tf1  # noqa: E402
    _tf1.register_keras_wrapper(DistributedOptimizer)
from aiak_training.keras import elastic  # noqa: F401,E402 - hvd.elastic, as in Horovod
