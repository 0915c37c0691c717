"""The sparse exchange: one allgather of every rank's (index, value) pairs, then scatter-add.

Ranks select different coordinates, and different numbers of them, so the pairs cannot be
summed by an allreduce.  Each rank packs the pairs of *all* its compressed tensors into one
byte buffer; a single ``allgather_async`` (which allows a different first dimension on every
rank) concatenates the buffers; every rank then adds all ranks' values into dense zeros, in
rank order, so all ranks compute bit-identical sums.  Indices that several ranks selected are
added, never overwritten.

One rank's segment (native little-endian; offsets relative to the segment's start, which is
a multiple of 8 bytes into the gathered buffer)::

    int32 counts[T]              pairs per compressed tensor, in the optimizer's fixed order
    int32 indices[sum(counts)]   tensor 0's indices, then tensor 1's, ...
    for each tensor t:           counts[t] values in tensor t's wire dtype, the block starting
                                 at a multiple of that dtype's item size
    zero padding                 to a multiple of 8 bytes

Every rank knows T, the order and the wire dtypes (same model, same options), so the header's
counts are all a receiver needs to walk the segments.  The bytes on the wire per rank are the
segment length: 4 bytes per tensor, 4 per index and 2/4/8 per value, plus padding.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from aiak_training.runtime.process_sets import ProcessSet, global_process_set
from aiak_training.dgc import _kernels
from aiak_training.torch.mpi_ops import allgather_async, synchronize


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def segment_layout(counts: Sequence[int], wire_dtypes: Sequence[torch.dtype]
                   ) -> Tuple[List[int], int]:
    """(offset of each tensor's value block, total segment bytes) for one rank's counts."""
    offset = 4 * len(counts) + 4 * sum(counts)
    value_offsets = []
    for count, dtype in zip(counts, wire_dtypes):
        size = _itemsize(dtype)
        offset = _align(offset, size)
        value_offsets.append(offset)
        offset += size * count
    return value_offsets, _align(offset, 8)


def pack(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """One rank's segment as a uint8 tensor (layout in the module docstring).

    ``indices[t]`` is int32; ``values[t]`` has tensor t's wire dtype and the same length.
    """
    counts = [int(i.numel()) for i in indices]
    wire = [v.dtype for v in values]
    value_offsets, total = segment_layout(counts, wire)
    buf = torch.zeros(total, dtype=torch.uint8)
    header = torch.tensor(counts, dtype=torch.int32)
    buf[: 4 * len(counts)] = header.view(torch.uint8)
    if sum(counts):
        start = 4 * len(counts)
        all_idx = torch.cat([i.to(torch.int32) for i in indices])
        buf[start: start + 4 * all_idx.numel()] = all_idx.view(torch.uint8)
    for vals, offset in zip(values, value_offsets):
        if vals.numel():
            raw = vals.contiguous().view(torch.uint8)
            buf[offset: offset + raw.numel()] = raw
    return buf


def parse_segments(buf: torch.Tensor, nranks: int, numels: Sequence[int],
                   wire_dtypes: Sequence[torch.dtype]
                   ) -> Iterator[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """Yield, for each rank in order, ``[(indices, values)]`` per tensor (views into ``buf``).

    The torch counterpart of the C++ parser; used by the fallback path and by tests.
    """
    T = len(numels)
    offset = 0
    total = buf.numel()
    for _ in range(nranks):
        if offset + 4 * T > total:
            raise RuntimeError("DGC exchange: truncated header")
        seg = buf[offset:]
        counts = seg[: 4 * T].view(torch.int32).tolist() if T else []
        for c, n in zip(counts, numels):
            if c < 0 or c > n:
                raise RuntimeError(f"DGC exchange: corrupt header (count {c})")
        value_offsets, length = segment_layout(counts, wire_dtypes)
        if offset + length > total:
            raise RuntimeError("DGC exchange: segment runs past the buffer")
        out = []
        idx_at = 4 * T
        for c, n, vo, dtype in zip(counts, numels, value_offsets, wire_dtypes):
            idx = seg[idx_at: idx_at + 4 * c].view(torch.int32)
            if c and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise RuntimeError(f"DGC exchange: index out of range for a tensor of {n} "
                                   "elements (ranks disagree on the compressed tensors?)")
            vals = seg[vo: vo + _itemsize(dtype) * c].view(dtype)
            out.append((idx, vals))
            idx_at += 4 * c
        yield out
        offset += length
    if offset != total:
        raise RuntimeError(f"DGC exchange: {total - offset} bytes left after {nranks} segments")


class PendingExchange:
    """An allgather in flight; :meth:`finish` scatter-adds the result into dense outputs."""

    def __init__(self, handle: int, sent_bytes: int, nranks: int,
                 wire_dtypes: Sequence[torch.dtype]):
        self.handle = handle
        self.sent_bytes = sent_bytes
        self.received_bytes = 0
        self.nranks = nranks
        self.wire_dtypes = list(wire_dtypes)

    def finish(self, outs: Sequence[torch.Tensor], scale: float = 1.0,
               use_native: Optional[bool] = None) -> int:
        """Wait for the allgather and add every rank's values, times ``scale``, into ``outs``
        (1-D, contiguous, float32/float64, usually zeroed by the caller).  Returns the number
        of pairs added."""
        gathered = synchronize(self.handle)
        self.received_bytes = int(gathered.numel())
        return _kernels.scatter_add_segments(gathered, self.nranks, outs, self.wire_dtypes,
                                             scale=scale, use_native=use_native)


def sparse_allgather_async(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                           name: Optional[str] = None,
                           process_set: ProcessSet = global_process_set) -> PendingExchange:
    """Start the exchange of this rank's pairs for every compressed tensor (one allgather)."""
    buf = pack(indices, values)
    handle = allgather_async(buf, name=name, process_set=process_set)
    return PendingExchange(handle, buf.numel(), process_set.size(), [v.dtype for v in values])


def sparse_sum(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               numels: Sequence[int], out_dtype: torch.dtype = torch.float32,
               name: Optional[str] = None, process_set: ProcessSet = global_process_set,
               use_native: Optional[bool] = None) -> List[torch.Tensor]:
    """Dense sums over all ranks of the sparse tensors given as (indices, values) pairs."""
    pending = sparse_allgather_async(indices, values, name=name, process_set=process_set)
    outs = [torch.zeros(n, dtype=out_dtype) for n in numels]
    pending.finish(outs, use_native=use_native)
    return outs
