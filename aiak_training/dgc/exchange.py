"""The sparse exchange: one allgather of every rank's (index, value) pairs, then scatter-add.

Ranks select different coordinates, and different numbers of them, so the pairs cannot be
summed by an allreduce.  Each rank packs the pairs of *all* its compressed tensors into one
byte buffer; a single ``allgather_async`` (which allows a different first dimension on every
rank) concatenates the buffers; every rank then adds all ranks' values into dense zeros, in
rank order, so all ranks compute bit-identical sums.  Indices that several ranks selected are
added, never overwritten.

The segment layout is in :mod:`aiak_training.dgc.wire`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from aiak_training.runtime.process_sets import ProcessSet, global_process_set
from aiak_training.dgc import _kernels
from aiak_training.dgc.wire import pack
from aiak_training.torch.mpi_ops import allgather_async, synchronize


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
