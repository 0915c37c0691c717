"""``import aiak_training.tensorflow.keras as hvd``: the ``horovod.tensorflow.keras`` API.
It is ``aiak_training.keras`` under Horovod's TensorFlow name (one implementation; it
follows the Keras of the process: Keras 3, or Keras 2 from ``tf_keras`` when
``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` resolve to it)."""
from aiak_training.keras import (Adasum, Average, Compression,  # noqa: F401
                                 DistributedOptimizer, HorovodInternalError, ProcessSet, Sum,
                                 add_process_set, allgather, allreduce, broadcast,
                                 broadcast_global_variables, ccl_built, cross_rank,
                                 cross_size, cuda_built, ddl_built, global_process_set,
                                 gloo_built, gloo_enabled, init, is_initialized, load_model,
                                 local_rank, local_size, mpi_built, mpi_enabled,
                                 mpi_threads_supported, nccl_built, rank, reducescatter,
                                 remove_process_set, rocm_built, shutdown, size,
                                 start_timeline, stop_timeline)
from aiak_training.keras import PartialDistributedOptimizer  # noqa: F401
from aiak_training.tensorflow.keras import callbacks  # noqa: F401
from aiak_training.tensorflow.keras import elastic  # noqa: F401,E402 - hvd.elastic
