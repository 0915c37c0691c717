"""Per-rank check of the engine's ring allreduce over MPI (csrc/engine/mpi.cpp).

Run with AIAK_MPI_RING_BYTES small enough that every tensor here takes the ring, and a small
segment, so that chunks split into several segments of unequal sizes.  Every dtype and
reduction is checked exactly against values computed here from what each rank contributes,
on the global set and on a process set of every other rank; the engine's counter says the
ring really ran once per allreduce.
"""
import os
import sys

import torch

import aiak_training.torch as hvd
from aiak_training.runtime import current

COUNTS = [1, 2, 5, 7, 1023, 4099, 65537]
if "--large" in sys.argv:
    COUNTS = [3 * 2 ** 20 + 1, 2 ** 19 + 3]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8,
          torch.int8, torch.int32, torch.int64]
OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}


def contribution(rank: int, ranks: list, count: int, op: str, dtype: torch.dtype,
                 seed: int) -> torch.Tensor:
    """What `rank` adds, as float64: small integers, so every result is exact in every dtype.
    For an average, the offsets cancel over `ranks`, so the mean is the shared base."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 4, (count,), generator=g).double()
    if op == "product":
        return (torch.randint(0, 2, (count,), generator=torch.Generator().manual_seed(seed + rank))
                + 1).double()
    if op == "average":
        k = ranks.index(rank)
        offset = float(k) if k < len(ranks) - 1 else -float(sum(range(len(ranks) - 1)))
        return base * len(ranks) + offset if dtype.is_signed or dtype.is_floating_point \
            else base * len(ranks)
    own = torch.randint(0, 4, (count,), generator=torch.Generator().manual_seed(seed + rank))
    return base + own.double()


def expected(ranks: list, count: int, op: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    values = torch.stack([contribution(r, ranks, count, op, dtype, seed) for r in ranks])
    out = {"sum": values.sum(0), "average": values.sum(0) / len(ranks),
           "min": values.min(0).values, "max": values.max(0).values,
           "product": values.prod(0)}[op]
    return out.to(dtype)


def check(process_set, ranks: list, label: str) -> int:
    runs = 0
    seed = 0
    for count in COUNTS:
        for dtype in DTYPES:
            for op_name, op in OPS.items():
                seed += 1
                if op_name == "average" and not dtype.is_floating_point:
                    continue
                mine = contribution(hvd.rank(), ranks, count, op_name, dtype, seed).to(dtype)
                name = f"{label}.{count}.{dtype}.{op_name}"
                out = hvd.allreduce(mine, op=op, name=name, process_set=process_set)
                want = expected(ranks, count, op_name, dtype, seed)
                assert out.dtype == dtype and out.shape == want.shape, name
                assert torch.equal(out, want), \
                    f"{name}: {(out.double() - want.double()).abs().max().item()} off"
                runs += 1
    return runs


size = int(os.environ.get("PMI_SIZE") or os.environ["OMPI_COMM_WORLD_SIZE"])
evens = hvd.ProcessSet(list(range(0, size, 2)))
hvd.init(process_sets=[evens])
assert os.environ["AIAK_MPI_RING_BYTES"] == "1", "every allreduce must take the ring"
core = current.engine().core
before = core.progress_counters()["ring_allreduces"]
runs = check(hvd.global_process_set, list(range(size)), "global")
if evens.included() and evens.size() > 1:
    runs += check(evens, list(range(0, size, 2)), "evens")
hvd.barrier()  # the ranks outside the set wait for it: a rank that shuts down ends the job
ring_runs = core.progress_counters()["ring_allreduces"] - before
assert ring_runs == runs, f"{ring_runs} ring allreduces for {runs} allreduces"
print(f"rank {hvd.rank()}: RING OK {runs} allreduces", flush=True)
hvd.shutdown()
