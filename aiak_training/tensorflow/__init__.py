"""``import aiak_training.tensorflow as hvd``: the horovod.tensorflow API (TensorFlow 2) on
aiak-training's engine.  Collectives work eagerly and inside ``tf.function``."""
from aiak_training.common.exceptions import HorovodInternalError  # noqa: F401
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set  # noqa: F401
from aiak_training.tensorflow.compression import Compression  # noqa: F401
from aiak_training.tensorflow.errors import (HorovodPreconditionError,  # noqa: F401
                                             HorovodUnknownError)
from aiak_training.tensorflow.functions import (allgather_object, broadcast_object,  # noqa: F401
                                                broadcast_object_fn, broadcast_variables)
from aiak_training.tensorflow.gradients import (DistributedGradientTape,  # noqa: F401
                                                PartialDistributedGradientTape,
                                                allreduce_gradients)
from aiak_training.tensorflow.mpi_ops import (Adasum, Average, Max, Min, Product, Sum,  # noqa: F401
                                              add_process_set, allgather, alltoall, barrier,
                                              broadcast, broadcast_, ccl_built,
                                              check_num_rank_power_of_2, cross_rank,
                                              cross_size, cuda_built, ddl_built, gloo_built,
                                              gloo_enabled, grouped_allgather,
                                              handle_average_backwards_compatibility, init,
                                              is_homogeneous, is_initialized, join,
                                              local_rank, local_rank_op, local_size,
                                              local_size_op, mpi_built, mpi_enabled,
                                              mpi_threads_supported, nccl_built,
                                              process_set_included_op, rank, rank_op,
                                              remove_process_set, rocm_built, shutdown, size,
                                              size_op, start_timeline, stop_timeline)
from aiak_training.tensorflow.reductions import (allreduce, grouped_allreduce,  # noqa: F401
                                                 grouped_reducescatter, reducescatter)
from aiak_training.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: F401
from aiak_training.tensorflow.tf1 import (BroadcastGlobalVariablesHook,  # noqa: F401
                                          DistributedOptimizer, broadcast_global_variables)
from aiak_training.tensorflow import elastic  # noqa: F401,E402 - hvd.elastic, as in Horovod
