"""Collectives whose results are known exactly, run while the emulated network is impaired.

Every rank derives every rank's inputs from seeds, so it can compute the exact expected
results on its own (integer values: float sums of them are exact).  Covers a grouped
allreduce on the global set (hierarchical when HOROVOD_HIERARCHICAL_ALLREDUCE=1), a grouped
allreduce on a process set (always the flat algorithm), DGC steps and overlapped optimizer
steps.  Prints ``FAULT_OPS OK rank=R ...`` when everything matched, else raises.
"""
import math
import socket
import sys
import time

import torch

import aiak_training.torch as hvd

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
NUMEL = 1 << 16  # 256 KiB of float32: several pipeline chunks with AIAK_HIER_CHUNK_BYTES=64K
SUBSET = [0, 1, 3]  # spans both nodes; process sets other than the global one run flat

subset = hvd.ProcessSet(SUBSET)
hvd.init(process_sets=[subset])
rank, size = hvd.rank(), hvd.size()
assert size == 4, size


def ints(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def grouped(step: int, process_set, members) -> int:
    dtypes = [torch.float32, torch.float64, torch.int64]
    inputs = [ints(1000 * rank + 10 * step + i, NUMEL, dt) for i, dt in enumerate(dtypes)]
    outs = hvd.grouped_allreduce(inputs, op=hvd.Sum, process_set=process_set,
                                 name=f"grouped.{process_set.process_set_id}.{step}")
    for i, (dt, out) in enumerate(zip(dtypes, outs)):
        expected = sum(ints(1000 * r + 10 * step + i, NUMEL, torch.int64) for r in members)
        assert out.dtype == dt and torch.equal(out.to(torch.int64), expected), (step, i)
    return len(outs)


def sparse_grad(r: int, step: int, shape, k: int) -> torch.Tensor:
    """Exactly k non-zero small integers at seeded places: DGC (density k/numel, no
    momentum) must send all of them, so the exchange is exact."""
    gen = torch.Generator().manual_seed(50_000 + 100 * r + step)
    numel = shape[0] * shape[1]
    grad = torch.zeros(numel)
    places = torch.randperm(numel, generator=gen)[:k]
    values = torch.randint(1, 9, (k,), generator=gen).float()
    signs = torch.randint(0, 2, (k,), generator=gen).float() * 2 - 1
    grad[places] = values * signs
    return grad.view(shape)


def dgc_steps(steps: int) -> int:
    shape, density = (256, 256), 0.01
    k = math.ceil(density * shape[0] * shape[1])  # what DGC sends per step
    weight = torch.nn.Parameter(torch.zeros(shape))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([weight], lr=1.0), named_parameters=[("dgc.weight", weight)],
        compression=hvd.Compression.dgc(density=density, warmup_densities=()))
    expected = torch.zeros(shape, dtype=torch.float64)
    for step in range(steps):
        opt.zero_grad()
        (weight * sparse_grad(rank, step, shape, k)).sum().backward()
        opt.step()
        assert opt.dgc_stats()["selected"] == k, opt.dgc_stats()  # the sparse path ran
        expected -= sum(sparse_grad(r, step, shape, k).double() for r in range(size)) / size
        assert torch.equal(weight.detach().double(), expected), ("dgc", step)
    return steps


def overlap_steps(steps: int) -> int:
    shapes = [(128, 256), (256, 256), (64, 512)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=1.0),
        named_parameters=[(f"overlap.{i}", p) for i, p in enumerate(params)],
        overlap_update=True)
    expected = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for step in range(steps):
        opt.zero_grad()
        grads = [ints(70_000 + 100 * rank + 10 * step + i, p.numel(), torch.float32).view(p.shape)
                 for i, p in enumerate(params)]
        sum((p * g).sum() for p, g in zip(params, grads)).backward()
        opt.step()
        for i, p in enumerate(params):
            avg = sum(ints(70_000 + 100 * r + 10 * step + i, p.numel(), torch.float64)
                      for r in range(size)).view(p.shape) / size
            expected[i] -= avg
            assert torch.equal(p.detach().double(), expected[i]), ("overlap", step, i)
    return steps


start = time.monotonic()
done = {"grouped": 0, "grouped_subset": 0}
for step in range(STEPS):
    done["grouped"] += grouped(step, hvd.global_process_set, range(size))
    if rank in SUBSET:
        done["grouped_subset"] += grouped(step, subset, SUBSET)
done["dgc"] = dgc_steps(STEPS)
done["overlap"] = overlap_steps(STEPS)
hvd.barrier()
print(f"FAULT_OPS OK rank={rank} host={socket.gethostname()} "
      + " ".join(f"{k}={v}" for k, v in done.items())
      + f" seconds={time.monotonic() - start:.1f}", flush=True)
