"""Gradient compressors: what a gradient becomes on the wire, and how it comes back.

A compressor is a pair of static functions.  ``compress(tensor)`` returns the tensor to
reduce and a context; ``decompress(reduced, context)`` turns the reduced tensor back into a
gradient.  ``hvd.Compression`` lists the algorithms by name.

Algorithms that live outside this frontend (deep gradient compression, in
``aiak_training.dgc``) are plugins: they declare themselves in the ``aiak_training.compressors``
entry-point group of their distribution, and ``hvd.Compression.<name>`` loads them on first
use.  The frontend therefore never imports them, and third parties can add their own.
"""
from importlib import metadata
from typing import Any, Callable, Dict, List, Sequence, Tuple, Type

import torch

PLUGIN_GROUP = "aiak_training.compressors"


class Compressor:
    """Base of all compressors; both functions are static."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """(tensor to send, context for ``decompress``)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The gradient recovered from a reduced tensor and the context of ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends gradients as they are (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point gradients as float16 and restores their dtype on arrival.

    Integer and bool tensors pass through untouched: narrowing them would change values.
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        wire = tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor
        return wire, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx.is_floating_point else tensor


def _plugins() -> Dict[str, "metadata.EntryPoint"]:
    return {ep.name: ep for ep in metadata.entry_points(group=PLUGIN_GROUP)}


class _Catalogue(type):
    """Resolves names that are not class attributes from the compressor plugins."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        plugin = _plugins().get(name)
        if plugin is None:
            known = sorted(set(cls.algorithms()))
            raise AttributeError(f"hvd.Compression has no algorithm {name!r} "
                                 f"(available: {', '.join(known)})")
        algorithm = plugin.load()
        setattr(cls, name, algorithm)  # later look-ups skip the entry-point scan
        return algorithm

    def __dir__(cls) -> List[str]:
        return sorted(set(super().__dir__()) | set(_plugins()))


class Compression(metaclass=_Catalogue):
    """The gradient compressors, by name: pass one as ``compression=`` to ``allreduce`` or
    ``DistributedOptimizer``.

    * ``none``: no compression (default);
    * ``fp16``: floating-point gradients travel as float16;
    * ``dgc``: deep gradient compression, ``Compression.dgc(density=0.001, ...)``; it sends
      sparse (index, value) pairs and works through ``DistributedOptimizer`` only (options
      in ``aiak_training.dgc.DGCCompressor``).
    """

    none = NoneCompressor
    fp16 = FP16Compressor

    @classmethod
    def algorithms(cls) -> List[str]:
        """Names of the built-in algorithms and of the installed plugins."""
        return ["none", "fp16"] + sorted(_plugins())


def run_compressed(compression: Type[Compressor], tensors: Sequence[torch.Tensor],
                   collective: Callable[[List[torch.Tensor]], Sequence[torch.Tensor]]
                   ) -> List[torch.Tensor]:
    """Run ``collective`` on the compressed ``tensors``; return its results decompressed."""
    if not tensors:
        raise ValueError("Expected at least one tensor.")
    encoded = [compression.compress(t) for t in tensors]
    results = collective([wire for wire, _ in encoded])
    return [compression.decompress(r, meta) for r, (_, meta) in zip(results, encoded)]
