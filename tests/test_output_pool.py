"""The memory pool behind out-of-place collective results (aiak_training/torch/output_pool.py)."""
import gc

import pytest
import torch

from aiak_training.torch.output_pool import OutputPool, empty_like

MIB = 1 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                   torch.int64, torch.int8, torch.uint8, torch.bool])
def test_results_are_ordinary_contiguous_tensors(dtype):
    pool = OutputPool(min_bytes=1024, max_cached_bytes=64 * MIB)
    t = pool.empty((3, 1000, 7), dtype)
    assert t.shape == (3, 1000, 7) and t.dtype == dtype and t.is_contiguous()
    assert t.device.type == "cpu" and not t.requires_grad
    src = (torch.arange(t.numel()) % 100).to(dtype).view(t.shape)
    t.copy_(src)
    assert torch.equal(t, src)
    assert torch.equal(t.clone() + 0, src + 0)


def test_freed_memory_is_reused_for_the_next_result_of_that_size():
    pool = OutputPool(min_bytes=MIB, max_cached_bytes=64 * MIB)
    a = pool.empty((2 * MIB // 4,), torch.float32)
    ptr = a.data_ptr()
    a.fill_(7)
    del a
    gc.collect()
    assert pool.cached_bytes == 2 * MIB
    view = pool.empty((MIB // 8, 4), torch.float32)  # same byte size, other shape
    assert view.data_ptr() == ptr and pool.hits == 1 and pool.cached_bytes == 0
    assert torch.all(view == 7)  # the same memory, not a copy
    other = pool.empty((3 * MIB // 4,), torch.float32)  # other size: a new block
    assert other.data_ptr() != ptr and pool.misses == 2


def test_a_view_keeps_the_memory_out_of_the_pool():
    pool = OutputPool(min_bytes=MIB, max_cached_bytes=64 * MIB)
    a = pool.empty((MIB,), torch.float32)
    half = a[: MIB // 2]
    del a
    gc.collect()
    assert pool.cached_bytes == 0  # ``half`` still uses the storage
    half.fill_(1)
    del half
    gc.collect()
    assert pool.cached_bytes == 4 * MIB


def test_small_results_and_a_zero_cap_bypass_the_pool():
    pool = OutputPool(min_bytes=MIB, max_cached_bytes=64 * MIB)
    small = pool.empty((100,), torch.float32)
    assert small.untyped_storage().resizable()  # plain torch.empty
    assert pool.hits == pool.misses == 0
    off = OutputPool(min_bytes=0, max_cached_bytes=0)
    t = off.empty((MIB,), torch.float32)
    assert t.untyped_storage().resizable() and off.misses == 0


def test_cache_is_capped():
    pool = OutputPool(min_bytes=MIB, max_cached_bytes=3 * MIB)
    a = pool.empty((2 * MIB,), torch.uint8)
    b = pool.empty((2 * MIB,), torch.uint8)
    del a, b
    gc.collect()
    assert pool.cached_bytes == 2 * MIB  # the second would exceed the cap
    pool.clear()
    assert pool.cached_bytes == 0


def test_empty_like_matches_torch_empty_like():
    t = torch.randn(300, 1000).t()  # non-contiguous input
    out = empty_like(t)
    assert out.shape == t.shape and out.dtype == t.dtype and out.is_contiguous()
