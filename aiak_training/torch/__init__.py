"""``import aiak_training.torch as hvd``: the horovod.torch API on aiak-training's engine."""
from aiak_training.common.exceptions import HorovodInternalError  # noqa: F401
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set  # noqa: F401
from aiak_training.torch.compression import Compression  # noqa: F401
from aiak_training.torch.functions import (allgather_object, broadcast_object,  # noqa: F401
                                           broadcast_optimizer_state, broadcast_parameters)
from aiak_training.torch.mpi_ops import (Adasum, Average, Max, Min, Product, Sum,  # noqa: F401
                                         add_process_set, allgather, allgather_async, allreduce,
                                         allreduce_, allreduce_async, allreduce_async_, alltoall,
                                         alltoall_async, barrier, broadcast, broadcast_,
                                         broadcast_async, broadcast_async_, ccl_built,
                                         cross_rank, cross_size, cuda_built, ddl_built,
                                         gloo_built, gloo_enabled, grouped_allgather,
                                         grouped_allgather_async, grouped_allreduce,
                                         grouped_allreduce_, grouped_allreduce_async,
                                         grouped_allreduce_async_, grouped_reducescatter,
                                         grouped_reducescatter_async, init, is_homogeneous,
                                         is_initialized, join, local_rank, local_size,
                                         mpi_built, mpi_enabled, mpi_threads_supported,
                                         nccl_built, poll, rank, reducescatter,
                                         reducescatter_async, remove_process_set, rocm_built,
                                         shutdown, size, sparse_allreduce_async,
                                         start_timeline, stop_timeline, synchronize)
from aiak_training.torch.optim import DistributedOptimizer  # noqa: F401
from aiak_training.torch.sync_batch_norm import SyncBatchNorm  # noqa: F401
from aiak_training.torch import elastic  # noqa: F401,E402 - hvd.elastic, as in Horovod
