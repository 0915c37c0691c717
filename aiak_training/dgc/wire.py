"""DGC's wire format: one rank's (index, value) pairs for all its compressed tensors,
packed into one byte segment.

One rank's segment (native little-endian; offsets relative to the segment's start, which is
a multiple of 8 bytes into the gathered buffer)::

    int32 counts[T]              pairs per compressed tensor, in the optimizer's fixed order
    int32 indices[sum(counts)]   tensor 0's indices, then tensor 1's, ...
    for each tensor t:           counts[t] values in tensor t's wire dtype, the block starting
                                 at a multiple of that dtype's item size
    zero padding                 to a multiple of 8 bytes

Every rank knows T, the order and the wire dtypes (same model, same options), so the header's
counts are all a receiver needs to walk the segments.

Every sender fills exactly ``k_t = ceil(density * numel_t)`` slots per tensor (the same on
all ranks): a tensor with fewer selected pairs pads its slots with index -1 (and value 0),
which receivers skip.  The layout is therefore known to every rank before anything arrives,
so a receiver on a GPU can add the pairs without reading the headers on the host.

The bytes on the wire per rank are the segment length: 4 bytes per tensor, 4 per index and
2/4/8 per value, plus padding.
"""
from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

import torch


#: The index of an empty slot.
PAD = -1


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
            vals = seg[vo: vo + _itemsize(dtype) * c].view(dtype)
            real = idx != PAD
            if not bool(real.all()):  # padded slots carry nothing
                idx, vals = idx[real], vals[real]
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise RuntimeError(f"DGC exchange: index out of range for a tensor of {n} "
                                   "elements (ranks disagree on the compressed tensors?)")
            out.append((idx, vals))
            idx_at += 4 * c
        yield out
        offset += length
    if offset != total:
        raise RuntimeError(f"DGC exchange: {total - offset} bytes left after {nranks} segments")


def pack_slots(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               header: torch.Tensor) -> torch.Tensor:
    """One rank's segment as a uint8 tensor on the values' device, from full slots.

    ``indices[t]`` (int32) and ``values[t]`` (wire dtype) have ``k_t`` entries each, empty
    slots last with index :data:`PAD`; ``header`` is the int32 tensor of the ``k_t`` on the
    same device (the caller keeps it: making it from a list would copy from the host and
    wait for the device).  Built by concatenation only, so nothing waits for the device.
    """
    counts = [int(i.numel()) for i in indices]
    value_offsets, total = segment_layout(counts, [v.dtype for v in values])
    device = header.device
    parts = [header.view(torch.uint8)]
    if sum(counts):
        parts.append(torch.cat([i.to(torch.int32) for i in indices]).view(torch.uint8))
    at = 4 * len(counts) + 4 * sum(counts)
    for vals, offset in zip(values, value_offsets):
        if offset > at:
            parts.append(torch.zeros(offset - at, dtype=torch.uint8, device=device))
        if vals.numel():
            parts.append(vals.contiguous().view(torch.uint8))
        at = offset + vals.numel() * vals.element_size()
    if total > at:
        parts.append(torch.zeros(total - at, dtype=torch.uint8, device=device))
    return torch.cat(parts)


def slot_views(buf: torch.Tensor, nranks: int, slots: Sequence[int],
               wire_dtypes: Sequence[torch.dtype]
               ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``(indices, values)`` per tensor, each shaped ``(nranks, k_t)``: views into a gathered
    buffer of slot-filled segments (see :func:`pack_slots`).  Checks only the length, which
    the host knows; raises ``RuntimeError`` when it is not ``nranks`` segments."""
    value_offsets, length = segment_layout(slots, wire_dtypes)
    if buf.numel() != nranks * length:
        raise RuntimeError(
            f"DGC exchange: got {buf.numel()} bytes, expected {nranks} segments of {length} "
            "bytes (ranks disagree on the compressed tensors or the density?)")
    rows = buf.view(nranks, length)
    out = []
    idx_at = 4 * len(slots)
    for k, vo, dtype in zip(slots, value_offsets, wire_dtypes):
        idx = rows[:, idx_at: idx_at + 4 * k].view(torch.int32)
        vals = rows[:, vo: vo + _itemsize(dtype) * k].view(dtype)
        out.append((idx, vals))
        idx_at += 4 * k
    return out
