"""``import aiak_training.tensorflow.keras as hvd``: the ``horovod.tensorflow.keras`` API for
Keras 3.  It is ``aiak_training.keras`` under Horovod's TensorFlow name (one implementation;
it follows the Keras backend of the process, normally TensorFlow here)."""
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
from aiak_training.tensorflow.keras import callbacks  # noqa: F401
