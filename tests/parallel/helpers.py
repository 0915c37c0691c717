"""Independent reference computations for per-rank tests.

Every rank can rebuild every other rank's input, because inputs are a pure function of
(rank, seed).  References are computed here with plain torch in float64 / exact integers,
never through the library under test.
"""
import os
from typing import List

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
    elif op == "average":
        out = wide.sum(0) * (1.0 / len(tensors))
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
        return value64.to(torch.float32).to(dtype)  # the engine scales halves via float
    return value64.to(dtype)


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
