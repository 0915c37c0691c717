"""``hvd.Compression.dgc``: the options of deep gradient compression, and the factory that
``hvd.DistributedOptimizer`` calls to build the DGC optimizer."""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from aiak_training.runtime.sets.process_sets import global_process_set
from aiak_training.dgc import _kernels
from aiak_training.dgc.schedule import PAPER_WARMUP_DENSITIES, DensitySchedule


class _DefaultInstanceMethod:
    """A method that also works on the class, then on an instance with default options.

    So both ``compression=hvd.Compression.dgc`` and ``compression=hvd.Compression.dgc(...)``
    work with ``hvd.DistributedOptimizer``, which looks the method up on what it is given.
    """

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj, owner):
        return functools.partial(self.fn, obj if obj is not None else owner())


class DGCCompressor:
    """Deep gradient compression (Lin et al., ICLR 2018) for ``hvd.DistributedOptimizer``.

    Usage::

        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.dgc(density=0.001, steps_per_epoch=len(loader)))

    Args:
        density: fraction of each compressed tensor's elements sent per step after warm-up
            (0.001 = 99.9% sparsity).  Each tensor sends ``ceil(density * numel)`` pairs
            (fewer if its residual has fewer non-zeros).
        momentum_masking: zero the velocity where values were sent (paper section 3.3).
        clip_norm: gradient clipping norm, as for ``torch.nn.utils.clip_grad_norm_``.  None:
            no clipping.
        local_clipping: with ``clip_norm``, clip each rank's local gradient before it is
            accumulated, at ``clip_norm / sqrt(N)`` (paper eq. 8); the norm is over all the
            optimizer's gradients.  False: clip the aggregated gradient at ``clip_norm``.
        warmup_densities: densities of the sparsity warm-up stages; ``()`` turns warm-up off.
            Default: the paper's 0.25, 0.0625, 0.015625, 0.004 (75% ... 99.6% sparsity).
        warmup_epochs: warm-up length in epochs (default 4, as the paper's CIFAR/ImageNet runs).
            The position comes from ``steps_per_epoch`` or from ``optimizer.set_epoch(epoch)``.
        steps_per_epoch: optimizer steps per epoch, to measure ``warmup_epochs`` in steps.
        warmup_steps: warm-up length in optimizer steps (overrides ``warmup_epochs``).
        min_numel: tensors with fewer elements go through the dense allreduce, as do 1-D
            tensors (biases, norm weights) and tensors that are not float32/float64.
        fp16_values: send values as float16 (indices are always int32); the rounding error
            stays in the residual.
        sample_ratio: fraction of a tensor sampled to estimate the selection threshold
            (raised automatically when too few samples would land above it).
        exact_topk: select over the whole tensor instead of from a sampled threshold.  The
            selected set is the same either way; this only costs time.
        seed: seeds the sample positions.
    """

    def __init__(self, density: float = 0.001, *, momentum_masking: bool = True,
                 clip_norm: Optional[float] = None, local_clipping: bool = True,
                 warmup_densities: Sequence[float] = PAPER_WARMUP_DENSITIES,
                 warmup_epochs: Optional[float] = 4.0, steps_per_epoch: Optional[int] = None,
                 warmup_steps: Optional[int] = None, min_numel: int = 1024,
                 fp16_values: bool = False, sample_ratio: float = 0.01,
                 exact_topk: bool = False, seed: int = 0):
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        if min_numel < 0:
            raise ValueError("min_numel must be >= 0")
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
        self.density = float(density)
        self.momentum_masking = bool(momentum_masking)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.local_clipping = bool(local_clipping)
        self.warmup_densities = tuple(warmup_densities)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.warmup_steps = warmup_steps
        self.min_numel = int(min_numel)
        self.fp16_values = bool(fp16_values)
        self.sample_ratio = float(sample_ratio)
        self.exact_topk = bool(exact_topk)
        self.seed = int(seed)
        self.schedule()  # validate the schedule options now, not at the first step

    def schedule(self) -> DensitySchedule:
        """The density schedule these options describe."""
        return DensitySchedule(self.density, self.warmup_densities,
                               warmup_steps=self.warmup_steps, warmup_epochs=self.warmup_epochs,
                               steps_per_epoch=self.steps_per_epoch)

    def compresses(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is sparsified (else it goes through the dense allreduce).

        The device does not matter: CPU tensors use the compiled kernels, others the same
        selection in torch ops (:mod:`aiak_training.dgc.device_select`)."""
        return (self._compressible_shape(p) and p.dtype in _kernels.COMPRESSIBLE_DTYPES
                and p.numel() < 2 ** 31)  # int32 indices

    def _compressible_shape(self, p: torch.Tensor) -> bool:
        return p.dim() > 1 and p.numel() >= max(self.min_numel, 1)

    def check_parameter(self, p: torch.Tensor, name: str, rank_device: Optional[int]) -> None:
        """Refuse what DGC cannot do exactly, naming the problem (``ValueError``).

        * A matrix parameter in half precision: its residual and velocity would accumulate
          in float16/bfloat16 and lose what DGC keeps for later, and going dense silently
          would turn DGC off for the whole model.
        * A CUDA parameter on another GPU than this rank's (``rank_device``): the exchange
          runs on the rank's device, and its collectives take one device per process.
        """
        check_parameter(self, p.device, p.dtype, self._compressible_shape(p), name,
                        rank_device)

    @_DefaultInstanceMethod
    def make_distributed_optimizer(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                                   backward_passes_per_step: int = 1, op: Optional[int] = None,
                                   gradient_predivide_factor: float = 1.0,
                                   process_set=global_process_set) -> torch.optim.Optimizer:
        """Build the DGC distributed optimizer (called by ``hvd.DistributedOptimizer``)."""
        from aiak_training.dgc.optimizer import make_dgc_optimizer
        from aiak_training.torch.mpi_ops import Average
        return make_dgc_optimizer(optimizer, self, named_parameters=named_parameters,
                                  backward_passes_per_step=backward_passes_per_step,
                                  op=Average if op is None else op,
                                  gradient_predivide_factor=gradient_predivide_factor,
                                  process_set=process_set)

    @staticmethod
    def compress(tensor):
        raise TypeError("Compression.dgc works through hvd.DistributedOptimizer only; it cannot "
                        "compress a single allreduce.")

    @staticmethod
    def decompress(tensor, ctx):
        raise TypeError("Compression.dgc works through hvd.DistributedOptimizer only.")

    def __repr__(self) -> str:
        return (f"Compression.dgc(density={self.density}, {self.schedule()!r}, "
                f"momentum_masking={self.momentum_masking}, clip_norm={self.clip_norm}, "
                f"local_clipping={self.local_clipping}, min_numel={self.min_numel}, "
                f"fp16_values={self.fp16_values}, exact_topk={self.exact_topk})")


def check_parameter(config: DGCCompressor, device: torch.device, dtype: torch.dtype,
                    compressible_shape: bool, name: str, rank_device: Optional[int]) -> None:
    """:meth:`DGCCompressor.check_parameter` on a parameter's device and dtype (apart, so
    that the device rule can be checked without a GPU)."""
    if compressible_shape and dtype in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"Compression.dgc: parameter {name!r} is {dtype}; DGC compresses float32 and "
            "float64 parameters only (its residual would lose small values in half "
            "precision).  Keep float32 parameters (mixed precision through torch.autocast), "
            f"or raise min_numel above {name!r}'s size to send it dense.")
    if device.type == "cuda" and rank_device is not None:
        index = device.index if device.index is not None else rank_device
        if index != rank_device:
            raise ValueError(
                f"Compression.dgc: parameter {name!r} is on cuda:{index}, but this rank "
                f"uses cuda:{rank_device}; DGC runs on the rank's device.  Call "
                "torch.cuda.set_device(hvd.local_rank()) before building the model, and keep "
                "all its parameters there.")
