"""The sparse exchange: one allgather of every rank's (index, value) pairs, then scatter-add.

Ranks select different coordinates, and different numbers of them, so the pairs cannot be
summed by an allreduce.  Each rank packs the pairs of *all* its compressed tensors into one
byte buffer; a single ``allgather_async`` (which allows a different first dimension on every
rank) concatenates the buffers; every rank then adds all ranks' values into dense zeros, in
rank order, so all ranks compute bit-identical sums.  Indices that several ranks selected are
added, never overwritten.

The segment layout is in :mod:`aiak_training.dgc.wire`.  The DGC optimizer fills ``k`` slots
per tensor on every rank, so the layout of the gathered buffer is known in advance: CPU
buffers go through the compiled parser (which reads the headers), buffers on other devices
are added with torch ops from fixed views, one rank at a time in rank order (never all ranks
in one ``index_add_``: on a GPU that would add duplicates in an unspecified order, and the
ranks' sums would differ in the last bit).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.dgc import _kernels
from aiak_training.dgc.wire import PAD, pack, pack_slots, segment_layout, slot_views
from aiak_training.torch.mpi_ops import allgather_async, synchronize


class PendingExchange:
    """An allgather in flight; :meth:`finish` scatter-adds the result into dense outputs."""

    def __init__(self, handle: int, sent_bytes: int, nranks: int,
                 wire_dtypes: Sequence[torch.dtype], slots: Optional[Sequence[int]] = None):
        self.handle = handle
        self.slots = None if slots is None else list(slots)
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
        native = _kernels.native_available() if use_native is None else use_native
        if self.slots is None or (gathered.device.type == "cpu" and native):
            return _kernels.scatter_add_segments(gathered, self.nranks, outs, self.wire_dtypes,
                                                 scale=scale, use_native=use_native)
        return add_slots(gathered, self.nranks, outs, self.slots, self.wire_dtypes, scale)


def add_slots(gathered: torch.Tensor, nranks: int, outs: Sequence[torch.Tensor],
              slots: Sequence[int], wire_dtypes: Sequence[torch.dtype],
              scale: float = 1.0) -> int:
    """Add every rank's slot-filled pairs, times ``scale``, into ``outs`` (zeros, 1-D) with
    torch ops on the buffer's device; returns the number of slots (nothing is read on the
    host).

    Empty slots are added as ``-0.0`` at index 0: adding -0.0 leaves every float unchanged
    (including -0.0), so they are no-ops without a data-dependent size.  When all tensors
    share their dtypes (the usual case) the pairs of one rank are added in one op into a
    flat buffer, then copied out with one foreach op: a few launches per rank in all."""
    views = slot_views(gathered, nranks, slots, wire_dtypes)
    uniform = len({(o.dtype, o.device) for o in outs}) == 1 and len(set(wire_dtypes)) == 1
    if uniform and len(outs) > 1:
        _add_slots_flat(gathered, nranks, outs, slots, wire_dtypes[0], scale)
        return nranks * sum(slots)
    for out, (idx, vals) in zip(outs, views):
        if idx.shape[1]:
            _add_rows(out, idx, vals, 0, scale, nranks)
    return nranks * sum(slots)


def _add_rows(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, shift,
              scale: float, nranks: int) -> None:
    """``out[idx[r] + shift] += vals[r] * scale`` for r in rank order, skipping PAD."""
    real = idx != PAD
    at = torch.where(real, idx.long() + shift, 0)
    src = torch.where(real, vals.to(out.dtype),
                      torch.full((), -0.0, dtype=out.dtype, device=out.device))
    for r in range(nranks):  # rank order: every rank adds in the same order
        out.index_add_(0, at[r], src[r], alpha=scale)


_SHIFTS: Dict[Any, torch.Tensor] = {}


def _add_slots_flat(gathered: torch.Tensor, nranks: int, outs: Sequence[torch.Tensor],
                    slots: Sequence[int], wire: torch.dtype, scale: float) -> None:
    """:func:`add_slots` for tensors of one dtype: the index and value blocks of all tensors
    are contiguous in a segment, so each rank's pairs are added in one ``index_add_``."""
    numels = [o.numel() for o in outs]
    value_at, length = segment_layout(slots, [wire] * len(slots))
    rows = gathered.view(nranks, length)
    k_total = sum(slots)
    start = 4 * len(slots)
    idx = rows[:, start: start + 4 * k_total].view(torch.int32)
    size = torch.empty((), dtype=wire).element_size()
    vals = rows[:, value_at[0]: value_at[0] + size * k_total].view(wire)
    key = (str(gathered.device), tuple(numels), tuple(slots))
    shift = _SHIFTS.get(key)
    if shift is None:  # each slot's offset in the flat buffer: made once (a host copy)
        if len(_SHIFTS) >= 8:
            _SHIFTS.clear()
        offsets, at = [], 0
        for n, k in zip(numels, slots):
            offsets += [at] * k
            at += n
        shift = _SHIFTS[key] = torch.tensor(offsets, dtype=torch.int64, device=gathered.device)
    flat = torch.zeros(sum(numels), dtype=outs[0].dtype, device=outs[0].device)
    _add_rows(flat, idx, vals, shift, scale, nranks)
    torch._foreach_add_(list(outs), list(flat.split(numels)))


def sparse_allgather_async(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                           name: Optional[str] = None,
                           process_set: ProcessSet = global_process_set,
                           header: Optional[torch.Tensor] = None) -> PendingExchange:
    """Start the exchange of this rank's pairs for every compressed tensor (one allgather).

    With ``header`` (the int32 slot counts, on the values' device) the pairs are slot-filled
    (see :func:`aiak_training.dgc.wire.pack_slots`) and the buffer stays on their device, so
    a CUDA buffer goes through the GPU allgather."""
    if header is None:
        buf, slots = pack(indices, values), None
    else:
        buf, slots = pack_slots(indices, values, header), [int(i.numel()) for i in indices]
    handle = allgather_async(buf, name=name, process_set=process_set)
    return PendingExchange(handle, buf.numel(), process_set.size(), [v.dtype for v in values],
                           slots)


def sparse_sum(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               numels: Sequence[int], out_dtype: torch.dtype = torch.float32,
               name: Optional[str] = None, process_set: ProcessSet = global_process_set,
               use_native: Optional[bool] = None) -> List[torch.Tensor]:
    """Dense sums over all ranks of the sparse tensors given as (indices, values) pairs."""
    pending = sparse_allgather_async(indices, values, name=name, process_set=process_set)
    outs = [torch.zeros(n, dtype=out_dtype) for n in numels]
    pending.finish(outs, use_native=use_native)
    return outs
