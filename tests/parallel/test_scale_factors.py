"""Prescale, postscale and Average, bit for bit as Horovod 0.28.1 computes them on CPU.

Horovod scales integers in float64 and truncates; float32, float16 (and here bfloat16) in
float32 arithmetic with the factor first rounded to float32; float64 in float64.  Average is
a Sum followed by a postscale of ``postscale / size``.  References come from
helpers.scale_like_horovod (numpy float32), on inputs whose sums are exact in whatever order
MPI adds them:

* "owned" elements are non-zero on one rank only (element i belongs to rank i % size), so a
  rounded prescaled value reaches the sum unchanged;
* "shared" elements are small integers on every rank; they are added only to calls without
  a prescale, whose rounding would make the sum order matter.

The owned elements of the half types are every finite value of the type, those of float32 a
wide random sample.  NEAR_1_5 is 1.5 in float32 but not in float64: scaling in float64 and
rounding once (what this library did before) gives thousands of different results, as do
postscales such as 0.3 / size, so these tests tell the two apart.

Run under an MPI launcher by tests/test_scale_factors.py at 2, 3 and 4 ranks.
"""
from typing import List

import numpy as np
import pytest
import torch

import aiak_training.torch as hvd
from helpers import cast_like, my_reducescatter_block, scale_like_horovod

NEAR_1_5 = 1.5 + 0.99 * 2.0 ** -24
DTYPES = [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPS = {"sum": hvd.Sum, "average": hvd.Average}
# (op, prescale, postscale)
CASES = [
    ("sum", NEAR_1_5, 1.0),
    ("sum", 1.0 / 3.0, 1.0),
    ("sum", 1.0, NEAR_1_5),
    ("sum", 1.0, 0.1),
    ("average", 1.0, 1.0),       # 1/size: inexact at 3 ranks
    ("average", 1.0, 0.3),       # 0.3/size: inexact at every size
    ("average", 1.0 / 3.0, NEAR_1_5),
]
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}


def case_id(case) -> str:
    op, pre, post = case
    return f"{op}-pre{pre:.4g}-post{post:.4g}"


def owned_values(dtype) -> torch.Tensor:
    """The values that owned elements take, the same on every rank (no zeros, no NaNs)."""
    g = torch.Generator().manual_seed(7)
    if dtype in (torch.float16, torch.bfloat16):
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        return every[torch.isfinite(every) & (every != 0)]
    if dtype == torch.float32:
        # Random sign, mantissa and exponent (2^-40 .. 2^40), and a few subnormals.
        mant = torch.randint(0, 1 << 23, (20000,), generator=g, dtype=torch.int32)
        exp = torch.randint(127 - 40, 127 + 40, (20000,), generator=g, dtype=torch.int32)
        sign = torch.randint(0, 2, (20000,), generator=g, dtype=torch.int32) << 31
        normal = (sign | (exp << 23) | mant).view(torch.float32)
        subnormal = torch.tensor([1e-45, -3e-39, 1.1e-38], dtype=torch.float32)
        return torch.cat([normal, subnormal])
    if dtype == torch.float64:
        return torch.randn(5000, generator=g, dtype=torch.float64) * 1e3
    # Truncation toward zero on both signs, and int64 values a float64 cannot hold exactly.
    # |x| * 2.25 (the largest product of factors here) stays within the type.
    bound = 1 << 29 if dtype == torch.int32 else 1 << 60
    small = torch.arange(-20, 21, dtype=dtype)
    return torch.cat([small[small != 0], torch.randint(-bound, bound, (5000,), generator=g,
                                                      dtype=dtype)])


def inputs(dtype, pre: float, seed: int = 0) -> List[torch.Tensor]:
    """Every rank's input: owned elements, then (without a prescale) shared ones."""
    n = hvd.size()
    values = owned_values(dtype)
    owner = torch.arange(values.numel()) % n
    out = [torch.where(owner == r, values, torch.zeros_like(values)) for r in range(n)]
    if pre == 1.0:
        shared = [torch.randint(-50, 51, (2000,), generator=torch.Generator().manual_seed(
            100 * seed + r)).to(dtype) for r in range(n)]
        out = [torch.cat([o, s]) for o, s in zip(out, shared)]
    return out


def expected(tensors: List[torch.Tensor], op: str, pre: float, post: float) -> torch.Tensor:
    """Horovod's result: each rank's input times ``pre``, summed (exactly, see the module
    docstring), times ``post`` (divided by the size for Average)."""
    dtype = tensors[0].dtype
    if pre != 1.0:  # Horovod skips a factor of exactly 1 (int64 would round through float64)
        tensors = [scale_like_horovod(t, pre) for t in tensors]
    total = tensors[0].to(torch.float64)
    for t in tensors[1:]:
        total = total + t.to(torch.float64)  # exact; -0 + 0 gives +0 as MPI's sum does
    total = cast_like(total, dtype)
    factor = post / len(tensors) if op == "average" else post
    return scale_like_horovod(total, factor) if factor != 1.0 else total


def assert_bits(actual: torch.Tensor, want: torch.Tensor) -> None:
    assert actual.dtype == want.dtype and actual.shape == want.shape
    view = BITS.get(actual.dtype)
    a, w = (actual.view(view), want.view(view)) if view else (actual, want)
    bad = (a != w).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise AssertionError(f"{len(bad)} of {a.numel()} elements differ; first at {i}: "
                             f"{actual[i].item()!r} instead of {want[i].item()!r}")


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce(dtype, case):
    op, pre, post = case
    tensors = inputs(dtype, pre)
    out = hvd.allreduce(tensors[hvd.rank()], op=OPS[op], prescale_factor=pre,
                        postscale_factor=post)
    assert_bits(out, expected(tensors, op, pre, post))


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_allreduce(dtype, case):
    # Several small tensors: they go through the fusion buffer (scaled unpack).
    op, pre, post = case
    groups = [inputs(dtype, pre, seed) for seed in range(3)]
    groups[1] = [t[:777] for t in groups[1]]
    outs = hvd.grouped_allreduce([g[hvd.rank()] for g in groups], op=OPS[op],
                                 prescale_factor=pre, postscale_factor=post)
    for out, g in zip(outs, groups):
        assert_bits(out, expected(g, op, pre, post))


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reducescatter(dtype, case):
    op, pre, post = case
    n, me = hvd.size(), hvd.rank()
    tensors = inputs(dtype, pre)
    out = hvd.reducescatter(tensors[me], op=OPS[op], prescale_factor=pre,
                            postscale_factor=post)
    assert_bits(out, my_reducescatter_block(expected(tensors, op, pre, post), me, n))


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_reducescatter(dtype, case):
    op, pre, post = case
    n, me = hvd.size(), hvd.rank()
    groups = [inputs(dtype, pre, seed) for seed in range(2)]
    groups[1] = [t[:3 * n + 1].reshape(-1, 1) for t in groups[1]]  # uneven rows, 2-D
    outs = hvd.grouped_reducescatter([g[me] for g in groups], op=OPS[op],
                                     prescale_factor=pre, postscale_factor=post)
    for out, g in zip(outs, groups):
        assert_bits(out, my_reducescatter_block(expected(g, op, pre, post), me, n))


def scaled_via_float64(tensors: List[torch.Tensor], op: str, pre: float,
                       post: float) -> torch.Tensor:
    """What the result would be if products were rounded once from float64."""
    dtype = tensors[0].dtype
    if pre != 1.0:
        tensors = [cast_like(t.to(torch.float64) * pre, dtype) for t in tensors]
    total = sum(t.to(torch.float64) for t in tensors)
    factor = post / len(tensors) if op == "average" else post
    return cast_like(cast_like(total, dtype).to(torch.float64) * factor, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_the_inputs_tell_float32_from_float64_scaling(dtype):
    """Guard on the test itself: the Sum cases with NEAR_1_5 (for float32: every case with
    an inexact factor) would come out differently if the engine rounded once from float64."""
    for op, pre, post in CASES:
        exact = op == "average" and pre == post == 1.0 and hvd.size() in (1, 2, 4)
        if (op == "sum" and NEAR_1_5 in (pre, post)) or (dtype == torch.float32 and not exact):
            tensors = inputs(dtype, pre)
            ours, old = expected(tensors, op, pre, post), scaled_via_float64(tensors, op, pre, post)
            assert not torch.equal(ours.view(BITS[dtype]), old.view(BITS[dtype])), (op, pre, post)
