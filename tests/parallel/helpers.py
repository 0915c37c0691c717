"""Independent reference computations for per-rank tests.

Every rank can rebuild every other rank's input, because inputs are a pure function of
(rank, seed).  References are computed here with plain torch / numpy (float64, exact
integers, or float32 where Horovod scales in float32), never through the library under test.
"""
import os
from typing import List

import numpy as np
import torch

INT_TYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOAT_TYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def rank_data(rank: int, shape, dtype, seed: int = 0) -> torch.Tensor:
    """Small integer-valued data, exactly representable in every dtype, so that sums,
    products (<= 4 ranks) and power-of-two scalings are exact even in fp16/bf16."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, shape, generator=g).to(dtype)


def reference_reduce(tensors: List[torch.Tensor], op: str) -> torch.Tensor:
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        stacked = torch.stack(tensors)
        return stacked.any(0) if op in ("sum", "max") else stacked.all(0)
    wide = torch.stack([t.to(torch.float64) for t in tensors])
    if op == "sum":
        out = wide.sum(0)
    elif op == "average":  # Horovod: the sum (exact for these inputs), then times 1/size
        return scale_like_horovod(cast_like(wide.sum(0), dtype), 1.0 / len(tensors))
    elif op == "min":
        out = wide.min(0).values
    elif op == "max":
        out = wide.max(0).values
    elif op == "product":
        out = wide.prod(0)
    else:
        raise ValueError(op)
    return cast_like(out, dtype)


def cast_like(value64: torch.Tensor, dtype) -> torch.Tensor:
    """float64 -> dtype with C-style truncation for integers (Horovod's integer scaling)."""
    if dtype in INT_TYPES:
        out = value64.trunc().to(torch.int64)
        if dtype == torch.uint8:
            return (out % 256).to(torch.uint8)
        return out.to(dtype)
    if dtype in (torch.float16, torch.bfloat16):
        return value64.to(torch.float32).to(dtype)
    return value64.to(dtype)


def scale_like_horovod(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` as Horovod 0.28.1's CPU ScaleBuffer computes it, here in numpy:
    integers in float64 and truncated; float32, float16 and bfloat16 in float32 arithmetic
    with the factor first rounded to float32 (then rounded to the half type); float64 in
    float64."""
    dtype = t.dtype
    if dtype == torch.float64:
        return torch.from_numpy(np.asarray(t.numpy() * np.float64(factor)))
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        with np.errstate(over="ignore"):  # overflow to inf is part of the semantics
            product = np.asarray(t.float().numpy() * np.float32(factor))  # float32 arithmetic
        assert product.dtype == np.float32
        return torch.from_numpy(product).to(dtype)
    return cast_like(torch.from_numpy(np.asarray(t.numpy().astype(np.float64) * factor)), dtype)


def expected_layout():
    """(node sizes) of the launch, from AIAK_TEST_LAYOUT like '2,2'; None if unknown."""
    layout = os.environ.get("AIAK_TEST_LAYOUT")
    return [int(x) for x in layout.split(",")] if layout else None


def my_reducescatter_block(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's rows of a reducescatter result: the first ``rows % size`` ranks get one
    extra row (Horovod's split), computed here independently of the engine."""
    base, extra = divmod(full.shape[0], size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(counts[:rank])
    return full[start:start + counts[rank]]
