"""Fused optimizers: one pass over memory per step for all parameters of a param group.

``FusedAdam``, ``FusedAdamW``, ``FusedSGD`` and ``FusedLAMB`` are drop-ins for the matching
``torch.optim`` classes (LAMB follows Apex's FusedLAMB).  They run SIMD multi-threaded kernels
on CPU (csrc/fused_optim) and multi-tensor-apply kernels on CUDA (csrc/cuda), and fall back to
torch ops where a kernel cannot be used.  :func:`maybe_fuse` swaps plain torch optimizers for
fused ones when ``AIAK_FUSED_OPTIMIZER=1``.
"""
from .adam import FusedAdam, FusedAdamW, fused_adam
from .lamb import FusedLAMB, fused_lamb, global_grad_norm
from .sgd import FusedSGD, fused_sgd
from .swap import ENV_VAR, fused_class_for, maybe_fuse
from ._backend import cpu_ext as _cpu_ext, cuda_lib, cuda_lib_error, cuda_library_path


def cpu_isa(threads: int = 1) -> str:
    """SIMD path the CPU kernels use on ``threads`` threads ('avx512', 'avx2' or 'scalar'):
    on AMD CPUs multi-threaded calls take AVX2 (see docs/fused-optimizers.md); 'unavailable'
    if the extension is not built."""
    return _cpu_ext.isa(threads) if _cpu_ext is not None else "unavailable"


__all__ = [
    "FusedAdam", "FusedAdamW", "FusedSGD", "FusedLAMB",
    "fused_adam", "fused_sgd", "fused_lamb", "global_grad_norm",
    "maybe_fuse", "fused_class_for", "ENV_VAR",
    "cpu_isa", "cuda_lib", "cuda_lib_error", "cuda_library_path",
]
