"""Reduce-scatter and allgather into memory the sharded optimizer owns.

The public ``reducescatter_async``/``allgather_async`` return new tensors, from the runtime's
output pool when large: up to 1 GiB of freed results is kept for reuse, and memory that is not
pooled goes back to glibc, whose mmap threshold rises after the first large free so that later
16 MiB blocks stay in its heap.  Either way, memory the sharded strategy freed would still
count in the process's peak.  Here the engine writes each result into a buffer the caller
allocated once (the shard's gradient, a reused gather buffer) and reuses every step.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from aiak_training.common.messages import OpType
from aiak_training.runtime.process_sets import ProcessSet
from aiak_training.torch import mpi_ops


def _into(out: torch.Tensor) -> Callable[..., Callable[[Tuple[int, ...]], int]]:
    """The ``allocate`` factory of ``_submit``: every output lands in ``out``."""
    def make(_index: int, _stream=None) -> Callable[[Tuple[int, ...]], int]:
        def allocate(shape: Tuple[int, ...]) -> int:
            numel = 1
            for d in shape:
                numel *= int(d)
            if numel > out.numel():  # another rank passed a larger bucket: never overrun
                raise RuntimeError(f"sharded optimizer: a collective result of {numel} "
                                   f"elements does not fit its {out.numel()}-element buffer; "
                                   "the ranks disagree on the model's parameters.")
            return out.data_ptr()
        return allocate
    return make


def reducescatter_into(src: torch.Tensor, out: torch.Tensor, name: str, op: int,
                       prescale: float, postscale: float, process_set: ProcessSet) -> int:
    """Start a reduce-scatter of the flat ``src`` whose block for this rank is written into
    ``out`` (``synchronize`` returns ``out``).  ``src`` must divide evenly over the ranks."""
    rop = mpi_ops._check_op(op, src)
    return mpi_ops._submit(OpType.REDUCESCATTER, [(src, out)],
                           mpi_ops._name("reducescatter", name), process_set, lambda _: out,
                           allocate=_into(out), reduce_op=int(rop), prescale=float(prescale),
                           postscale=float(postscale))


def allgather_into(src: torch.Tensor, out: torch.Tensor, name: str,
                   process_set: ProcessSet) -> int:
    """Start an allgather of the equal-sized flat ``src`` of every rank into the first
    ``size * src.numel()`` elements of ``out`` (``synchronize`` returns that view).  ``src``
    may be this rank's own block of ``out``: the gather then runs in place."""
    n = process_set.size() if process_set.process_set_id else mpi_ops.size()
    full = out[:n * src.numel()]
    return mpi_ops._submit(OpType.ALLGATHER, [(src, out)], mpi_ops._name("allgather", name),
                           process_set, lambda _: full, allocate=_into(out))


class BufferCache:
    """Flat buffers kept for reuse, so that a transient buffer needed every step is allocated
    once rather than once per step.

    A buffer serves any request it is large enough for (the caller slices it), so buckets of
    many different sizes share a few buffers.  Per dtype and device, as many free ones are
    kept as were ever in use at once (at least ``keep``; the smallest go first): a steady
    workload then allocates nothing after its first step, and what stays allocated between
    steps is what its busiest moment needed."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
        self._in_use: Dict[Tuple[torch.dtype, torch.device], int] = {}
        self._peak: Dict[Tuple[torch.dtype, torch.device], int] = {}

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements of ``like``'s dtype and device
        (contents undefined); give the whole buffer back, not a slice."""
        kind = (like.dtype, like.device)
        self._in_use[kind] = used = self._in_use.get(kind, 0) + 1
        self._peak[kind] = max(self._peak.get(kind, 0), used)
        free = self._free.get(kind, [])
        fits = [i for i, buf in enumerate(free) if buf.numel() >= numel]
        if fits:
            return free.pop(min(fits, key=lambda i: free[i].numel()))
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def give(self, buf: torch.Tensor) -> None:
        """Return ``buf`` (nothing may use it any more) for a later :meth:`take`."""
        kind = (buf.dtype, buf.device)
        self._in_use[kind] = max(0, self._in_use.get(kind, 0) - 1)
        free = self._free.setdefault(kind, [])
        free.append(buf)
        if len(free) > max(self.keep, self._peak.get(kind, 0)):
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))

    def buffers(self) -> List[torch.Tensor]:
        """The free buffers held now."""
        return [buf for free in self._free.values() for buf in free]
