"""Per-rank check of the engine's reduce-scatter and allgather (flat or hierarchical).

Every rank builds every rank's input from a seed, so each expected result is computed here
with numpy, independently of any collective.  Values are small integers (exact in float32 in
any summation order), so flat and hierarchical results must equal the expectation exactly.

argv[1]: "hier" or "flat", the path the engine must have taken for the global set.  The path
is read from what the engine ran, not from its selection rule: "hier" when the two-level
object it made (aiak_training.allreduce.hier_scatter.made()) ran every one of these
collectives, "flat" when it made none.
Prints "sharded collectives ok: rank R path P checks K" on success; any mismatch raises.
"""
import sys

import numpy as np
import torch

import aiak_training.torch as hvd
from aiak_training.allreduce import hier_scatter


def rows_of(total_rows: int, size: int):
    """Horovod's split: the lowest ranks get one more row when rows do not divide."""
    base, extra = divmod(total_rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def input_of(rank: int, shape, dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    return rng.integers(-8, 9, size=shape).astype(dtype)


def main() -> None:
    want_path = sys.argv[1]
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = 0
    collectives = 0  # reduce-scatters and allgathers submitted, each non-empty

    # reduce-scatter: rows that divide and rows that do not; Sum, Average, scale factors.
    cases = [((8 * size, 3), np.float32, hvd.Sum, 1.0, 1.0),
             ((5 * size + 3, 7), np.float32, hvd.Average, 1.0, 1.0),
             ((3 * size + 1,), np.float32, hvd.Sum, 0.5, 4.0),
             ((2 * size + 1, 2, 3), np.int32, hvd.Sum, 1.0, 1.0),
             ((4 * size + 2, 5), np.float64, hvd.Max, 1.0, 1.0),
             ((1,), np.float32, hvd.Sum, 1.0, 1.0)]  # fewer rows than ranks
    for seed, (shape, dtype, op, pre, post) in enumerate(cases):
        inputs = [input_of(r, shape, dtype, seed) for r in range(size)]
        if op == hvd.Max:
            full = np.max(inputs, axis=0)
        else:
            full = np.sum([x * pre if pre != 1.0 else x for x in inputs], axis=0)
            # The engine multiplies by the factor rounded to the tensor's type (Horovod's
            # arithmetic), Average's 1/size folded into it.
            factor = post / size if op == hvd.Average else post
            full = full * np.asarray(factor, dtype=dtype) if factor != 1.0 else full
        rows = rows_of(shape[0], size)
        start = sum(rows[:rank])
        expect = full[start:start + rows[rank]].astype(dtype)
        got = hvd.reducescatter(torch.from_numpy(inputs[rank].copy()), op=op,
                                name=f"rs.{seed}", prescale_factor=pre,
                                postscale_factor=post).numpy()
        assert got.shape == expect.shape, (seed, got.shape, expect.shape)
        assert np.array_equal(got, expect), (seed, got, expect)
        checks += 1
        collectives += 1

    # allgather: equal first dimensions, and a different one per rank (rank r: r + 1 rows).
    for seed, (rows, tail, dtype) in enumerate([([4] * size, (3,), np.float32),
                                                 (list(range(1, size + 1)), (2, 2), np.int64),
                                                 ([0] * (size - 1) + [3], (5,), np.float32)]):
        pieces = [input_of(r, (rows[r],) + tail, dtype, 100 + seed) for r in range(size)]
        expect = np.concatenate(pieces, axis=0)
        got = hvd.allgather(torch.from_numpy(pieces[rank].copy()), name=f"ag.{seed}").numpy()
        assert got.shape == expect.shape, (seed, got.shape, expect.shape)
        assert np.array_equal(got, expect), (seed, got, expect)
        checks += 1
        collectives += 1

    # A round trip as the sharded optimizer makes it, several times (buffers are reused).
    for step in range(3):
        grads = [input_of(r, (6 * size,), np.float32, 200 + step) for r in range(size)]
        shard = hvd.reducescatter(torch.from_numpy(grads[rank].copy()), op=hvd.Sum,
                                  name=f"trip.rs.{step}")
        back = hvd.allgather(shard, name=f"trip.ag.{step}").numpy()
        assert np.array_equal(back, np.sum(grads, axis=0)), step
        checks += 1
        collectives += 2
    # The allgather in place, as the sharded optimizer runs it: each rank sends its block
    # of the output buffer itself; the other blocks start as garbage.
    blocks = [input_of(r, (5,), np.float32, 300) for r in range(size)]
    out = torch.full((5 * size,), float("nan"))
    out[5 * rank:5 * rank + 5] = torch.from_numpy(blocks[rank])
    got = hvd.synchronize(hvd.allgather_async(out[5 * rank:5 * rank + 5], "inplace.ag",
                                              hvd.global_process_set, out=out))
    assert got.data_ptr() == out.data_ptr()
    assert np.array_equal(out.numpy(), np.concatenate(blocks)), out
    checks += 1
    collectives += 1
    runs = [h.runs for h in hier_scatter.made()]
    assert runs in ([], [collectives]), (runs, collectives)  # all flat, or all hierarchical
    path = "hier" if runs else "flat"
    assert path == want_path, (path, want_path)
    print(f"sharded collectives ok: rank {rank} path {path} checks {checks}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
