"""Deep gradient compression (DGC, Lin et al., ICLR 2018) for ``hvd.DistributedOptimizer``.

``hvd.DistributedOptimizer(opt, named_parameters=..., compression=hvd.Compression.dgc(...))``
turns it on; see docs/dgc.md for the user guide and :class:`DGCCompressor` for the
options.
"""
from aiak_training.dgc._kernels import native_available, select_topk  # noqa: F401
from aiak_training.dgc.compressor import DGCCompressor  # noqa: F401
from aiak_training.dgc.exchange import sparse_allgather_async, sparse_sum  # noqa: F401
from aiak_training.dgc.schedule import PAPER_WARMUP_DENSITIES, DensitySchedule  # noqa: F401

__all__ = ["DGCCompressor", "DensitySchedule", "PAPER_WARMUP_DENSITIES", "select_topk",
           "sparse_allgather_async", "sparse_sum", "native_available"]
