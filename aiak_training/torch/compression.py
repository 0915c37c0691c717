"""Gradient compression algorithms."""
from typing import Any, Tuple

import torch


class Compressor:
    """Interface for compressing and decompressing a given tensor."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Compresses a tensor and returns it with the context needed to decompress it."""

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Decompress the tensor with the given context."""


class NoneCompressor(Compressor):
    """Default no-op compression."""

    @staticmethod
    def compress(tensor):
        """Returns the tensor unmodified."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the tensor unmodified."""
        return tensor


class FP16Compressor(Compressor):
    """Compress all floating point gradients to 16-bit."""

    @staticmethod
    def compress(tensor):
        """Downcasts the tensor to 16-bit."""
        tensor_compressed = tensor
        if tensor.dtype.is_floating_point:
            # Only allow compression from other floating point types
            tensor_compressed = tensor.type(torch.float16)
        return tensor_compressed, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        """Upcasts the tensor to the initialization dtype."""
        tensor_decompressed = tensor
        dtype = ctx
        if dtype.is_floating_point:
            tensor_decompressed = tensor.type(dtype)
        return tensor_decompressed


class _LazyDGC:
    """``Compression.dgc``: the DGC compressor class, imported on first use (aiak_training.dgc
    imports this module, so it cannot be imported here at load time)."""

    def __get__(self, obj, owner):
        from aiak_training.dgc import DGCCompressor
        return DGCCompressor


class Compression:
    """Optional gradient compression algorithm used during allreduce."""

    """Do not compress the gradients. This is the default."""
    none = NoneCompressor

    """Compress all floating point gradients to 16-bit."""
    fp16 = FP16Compressor

    """Deep gradient compression: ``Compression.dgc(density=0.001, ...)`` (options in
    aiak_training.dgc.DGCCompressor).  Sparsifies gradients with momentum correction and
    exchanges (index, value) pairs; works through ``DistributedOptimizer`` only."""
    dgc = _LazyDGC()
