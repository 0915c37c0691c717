"""The numpy result pool of the framework-neutral layer (aiak_training.runtime.arrays.array_pool):
alignment, reuse, and that memory comes back only when no derived array uses it."""
import gc

import numpy as np

from aiak_training.runtime.arrays.array_pool import ALIGN, ArrayPool


def test_small_and_large_results_are_aligned_and_shaped():
    pool = ArrayPool(min_bytes=1 << 16, max_cached_bytes=1 << 24)
    for shape, dtype in (((3, 5), np.float32), ((0,), np.int8), ((), np.float64),
                         ((1 << 15, 3), np.float16)):
        a = pool.empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert a.size == 0 or a.ctypes.data % ALIGN == 0


def test_block_returns_only_after_every_derived_array_is_gone():
    pool = ArrayPool(min_bytes=1 << 16, max_cached_bytes=1 << 24)
    a = pool.empty((1 << 16,), np.float32)
    address = a.ctypes.data
    view = a.view(np.uint16)[10:].reshape(2, -1)  # what a framework might keep
    capsule = view.__dlpack__()
    del a
    gc.collect()
    assert pool.released == 0
    b = pool.empty((1 << 16,), np.float32)  # must not get the block still in use
    assert b.ctypes.data != address
    del view, capsule
    gc.collect()
    assert pool.released == 1
    c = pool.empty((1 << 16,), np.float32)
    assert c.ctypes.data == address and pool.hits == 1


def test_cap_and_disabled_pool():
    pool = ArrayPool(min_bytes=1 << 16, max_cached_bytes=1 << 17)
    blocks = [pool.empty((1 << 17,), np.uint8) for _ in range(3)]
    del blocks
    gc.collect()
    assert pool.released == 3 and pool.cached_bytes <= 1 << 17
    off = ArrayPool(min_bytes=1 << 16, max_cached_bytes=0)
    off.empty((1 << 20,), np.uint8)
    assert off.hits == off.misses == 0
