"""Reused, aligned host memory for the numpy results of collectives.

Fresh memory from the system costs a page fault per 4 KiB on first touch, which for large
results takes longer than the reduction itself.  Large results (``AIAK_OUTPUT_POOL_MIN_BYTES``,
1 MiB) therefore come from blocks that earlier results gave back, at most
``AIAK_OUTPUT_POOL_BYTES`` (1 GiB; 0 turns the pool off) of them kept: the same policy and
variables as the torch frontend's pool.

A result is a view of a :class:`_Lease`, an object that exposes the block's bytes through
``__array_interface__``.  Every array derived from the result (reshapes, dtype views, the
array a framework holds through DLPack) keeps the lease alive, so the block returns to the
pool exactly when the last of them is gone; a finalizer on the lease does that.
"""
import threading
import weakref
from typing import Dict, List, Sequence

import numpy as np

from aiak_training.common.env import env_bytes

ALIGN = 64          # bytes: a cache line, and what TensorFlow's CPU allocator guarantees
_ROUND = 64 << 10   # block sizes are rounded to 64 KiB so that near sizes share blocks


class _Lease:
    """The bytes ``[start, start + nbytes)`` of a pooled block, for ``np.asarray``."""
    __slots__ = ("__array_interface__", "block", "__weakref__")

    def __init__(self, block: np.ndarray, nbytes: int) -> None:
        self.block = block
        start = block.ctypes.data + (-block.ctypes.data) % ALIGN
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                    "data": (start, False), "version": 3}


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


class ArrayPool:
    def __init__(self, min_bytes: int, max_cached_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.max_cached_bytes = max_cached_bytes
        self._free: Dict[int, List[np.ndarray]] = {}
        self._cached = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.released = 0

    @property
    def cached_bytes(self) -> int:
        return self._cached

    @property
    def cached_blocks(self) -> int:
        """Free blocks held for reuse."""
        with self._lock:
            return sum(len(blocks) for blocks in self._free.values())

    @property
    def outstanding(self) -> int:
        """Pooled results handed out whose memory has not come back yet: the ones something
        still uses.  Leak checks expect it to stay bounded over a long run."""
        with self._lock:
            return self.hits + self.misses - self.released

    def empty(self, shape: Sequence[int], dtype) -> np.ndarray:
        """An uninitialized C-contiguous array whose data starts on an :data:`ALIGN`
        boundary; large ones reuse memory that earlier results gave back."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < self.min_bytes or self.max_cached_bytes <= 0:
            return _aligned(nbytes).view(dtype).reshape(shape)
        size = -(-nbytes // _ROUND) * _ROUND
        with self._lock:
            blocks = self._free.get(size)
            block = blocks.pop() if blocks else None
            if block is None:
                self.misses += 1
            else:
                self._cached -= size
                self.hits += 1
        if block is None:
            block = np.empty(size + ALIGN, dtype=np.uint8)
        lease = _Lease(block, nbytes)
        weakref.finalize(lease, self._release, block, size)
        return np.asarray(lease).view(dtype).reshape(shape)

    def _release(self, block: np.ndarray, size: int) -> None:
        with self._lock:
            self.released += 1
            if self._cached + size > self.max_cached_bytes:
                return  # over the cap: the memory goes back to the system
            self._free.setdefault(size, []).append(block)
            self._cached += size

    def clear(self) -> None:
        """Give every cached block back to the system."""
        with self._lock:
            self._free.clear()
            self._cached = 0


pool = ArrayPool(env_bytes("AIAK_OUTPUT_POOL_MIN_BYTES", 1 << 20),
                 env_bytes("AIAK_OUTPUT_POOL_BYTES", 1 << 30))
