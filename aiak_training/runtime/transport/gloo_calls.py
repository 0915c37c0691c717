"""The Gloo collectives of the engine's C++ core (``csrc/engine/python_transport.cpp``).

The C++ engine negotiates, fuses and caches for Gloo jobs as it does for MPI ones; only its
transport calls land here.  Each method is called on the engine's native thread with the GIL
held for that call alone, and runs one collective on a :class:`GlooComm`'s process group
(torch releases the GIL while Gloo waits).  The handles the engine passes are small
integers: communicators are registered here (:meth:`GlooCalls.register`), element types are
:class:`DataType` codes (plus :data:`UINT64` for negotiation's bit vector) and reduce ops are
indices into :data:`OP_WORDS`.
"""
import ctypes
from typing import Any, Dict

import torch

from aiak_training.common.dtypes import DataType
from aiak_training.runtime.transport.gloo_comm import GlooComm, byte_view

#: Element-type handle of negotiation's bit vector (only ever reduced with BAND, which is the
#: same on int64).
UINT64 = 100
#: Reduce-op ids: the index of each word (the words GlooComm.allreduce_tensor reduces).
OP_WORDS = ("sum", "min", "max", "prod", "lor", "land", "band")


def _at(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``addr`` (the engine's memory, not copied)."""
    return byte_view((ctypes.c_char * nbytes).from_address(addr), nbytes)


def _ints(addr: int, n: int) -> list:
    return list((ctypes.c_int * n).from_address(addr))


class GlooCalls:
    """The communicators of one engine, by comm id, and the collectives it calls."""

    def __init__(self) -> None:
        self._comms: Dict[int, GlooComm] = {}
        self._next = 1

    def register(self, comm: GlooComm) -> int:
        """The handle the engine will name ``comm`` by."""
        handle, self._next = self._next, self._next + 1
        self._comms[handle] = comm
        return handle

    def forget(self, handle: int) -> None:
        self._comms.pop(handle, None)

    @staticmethod
    def config() -> Dict[str, Any]:
        """The handle values of the engine's configuration (see engine._core_config)."""
        out = {word.upper(): index for index, word in enumerate(OP_WORDS)}
        out.update(UINT64_T=UINT64, INT32_T=int(DataType.INT32), INT64_T=int(DataType.INT64),
                   BYTE=int(DataType.UINT8), dtypes=[int(d) for d in DataType])
        return out

    # ---- called by the engine thread ----------------------------------------------------
    def allreduce(self, data: memoryview, dtype: int, op: int, comm: int) -> None:
        group = self._comms[comm]
        if group.Get_size() > 1:
            kind = DataType.INT64 if dtype == UINT64 else DataType(dtype)
            group.allreduce_tensor(byte_view(data, len(data)), kind, OP_WORDS[op])

    def bcast(self, data: memoryview, root: int, comm: int) -> None:
        group = self._comms[comm]
        if group.Get_size() > 1:
            group.broadcast_tensor(byte_view(data, len(data)), root)

    def gather(self, data: memoryview, recv: int, root: int, comm: int) -> None:
        """Equal pieces from every rank, back to back at ``recv`` on the root."""
        group = self._comms[comm]
        size, rank, nbytes = group.Get_size(), group.Get_rank(), len(data)
        mine = byte_view(data, nbytes)
        out = _at(recv, size * nbytes) if rank == root and nbytes else None
        if size == 1:
            if out is not None:
                out.copy_(mine)
            return
        group._gather_tensor(mine, None if out is None else list(out.chunk(size)), root)

    def gatherv(self, data: memoryview, recv: int, counts: int, displs: int, item: int,
                root: int, comm: int) -> None:
        """Pieces of any length (``counts``/``displs``: int arrays, in ``item``-byte elements,
        read on the root) gathered at ``recv`` on the root."""
        group = self._comms[comm]
        size, rank, nbytes = group.Get_size(), group.Get_rank(), len(data)
        mine = byte_view(data, nbytes)
        if rank == root:
            sizes = [c * item for c in _ints(counts, size)]
            starts = [d * item for d in _ints(displs, size)]
        if size == 1:
            if nbytes:
                _at(recv + starts[0], nbytes).copy_(mine)
            return
        # Gloo gathers equal pieces: every rank pads to the widest, which only the root knew.
        width = torch.tensor([nbytes], dtype=torch.int64)
        group.allreduce_tensor(width.view(torch.uint8), DataType.INT64, "max")
        padded = torch.zeros(int(width.item()), dtype=torch.uint8)
        padded[:nbytes].copy_(mine)
        pieces = [torch.empty_like(padded) for _ in range(size)] if rank == root else None
        group._gather_tensor(padded, pieces, root)
        if rank == root:
            for piece, n, start in zip(pieces, sizes, starts):
                if n:
                    _at(recv + start, n).copy_(piece[:n])
