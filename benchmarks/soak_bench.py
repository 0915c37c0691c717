"""Soak benchmark: a long run of training steps, watching memory and the runtime's tables.

Run with an MPI launcher, e.g.::

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/soak_bench.py --json out.json

The workload is a small BERT-shaped model with exactly 300 parameter tensors (fixed seed): 187
small ones (biases, LayerNorm weights, the decoder bias; 128 to 8,192 elements), 110 medium
ones (attention and feed-forward matrices, 16K to 64K elements), and 3 of a few MiB (word
embedding and untied decoder, 4 MiB each; position embedding, 1 MiB); 23 MiB in all.  Each
step, on every rank:

* forward and backward on a fresh random batch (--batch sequences of --seq tokens, by
  default 1 x 16: the soak is about the runtime, so the model's arithmetic is kept small;
  cross-entropy on random targets);
* ``hvd.DistributedOptimizer(FusedAdamW).step()``: the backward hooks start one
  ``allreduce_async_`` per gradient (300 of them), ``step()`` synchronizes them all and
  updates;
* ``hvd.allreduce(loss)``: the averaged loss, as a job logs it (out of place, a scalar);
* every 10th step, a consistency check of all 300 parameters across ranks, alternating two
  out-of-place APIs: ``hvd.grouped_allreduce`` (steps 0, 20, ...) and ``allreduce_async``
  plus ``synchronize`` per tensor (steps 10, 30, ...); the averages must equal the local
  parameters bit for bit (ranks hold identical weights), mismatches are counted;
* every 100th step, ``hvd.allgather`` of a small per-rank statistics tensor and
  ``hvd.broadcast_`` of a small one from rank 0 (the engine's allocate-on-negotiation path).

So each step runs about 300 in-place async allreduces, and the out-of-place paths (output
pool for results of 1 MiB or more, handle map, allocation callbacks) run thousands of times.

Figures: resident memory (RSS, from /proc/self/statm) after warm-up (step --warmup-steps)
and at the end, sampled every --sample-every steps; the runtime's tables
(``aiak_training.runtime.basics.runtime_counts``: open handles, pending entries, response
cache, negotiation tables, process sets, fusion buffer) at warm-up and at the end; the
frontend's handle map; the output pool (cached blocks and bytes, results outstanding); the
number of Python objects the garbage collector tracks; and, as a diagnostic taken after
everything else, the RSS once glibc's malloc_trim has returned free heap pages.  Every rank
measures; rank 0 reports.

Ratios (these are not speed ratios: lower is better, targets in brackets):

  rss_growth_pct         largest over ranks of 100 * (RSS at the end - RSS after warm-up) /
                         RSS after warm-up.  [< 1]
  leaked_handles         summed over ranks, at the end, with every operation synchronized:
                         the engine's open handles plus the frontend's handle-map entries
                         (handles returned by an async call and never synchronized).  [0]
  runtime_table_growth   summed over ranks, how much the runtime's tables (every count of
                         runtime_counts except fusion_buffer_bytes, plus the frontend handle
                         map and the output pool's outstanding results) grew between
                         warm-up and the end.  [0]
  pool_cached_growth     summed over ranks, growth of the output pool's cached free blocks
                         between warm-up and the end.  [0]

The results hold one row per rank: its median/min/max step time over all steps (the step as
above, including the periodic checks) and, in params, its RSS samples and table counts.
"""
import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aiak_training.torch as hvd  # noqa: E402
from aiak_training.fused_optim import FusedAdamW  # noqa: E402
from aiak_training.runtime import basics  # noqa: E402
from aiak_training.torch import output_pool, submission  # noqa: E402
from bench_common import machine_info  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


# ---- the model: BERT-shaped, 300 parameter tensors ---------------------------------------------
class Layer(nn.Module):
    """One encoder layer: separate q/k/v/o projections, feed-forward, two LayerNorms (16
    tensors)."""

    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff_in, self.ff_out = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        x = self.ln1(x + self.o(a.transpose(1, 2).reshape(b, t, d)))
        return self.ln2(x + self.ff_out(F.gelu(self.ff_in(x))))


class Model(nn.Module):
    """Embeddings (word, position, LayerNorm), 18 layers, pooler, and an MLM-style head with an
    untied decoder: 4 + 18 * 16 + 2 + 6 = 300 tensors."""

    def __init__(self, vocab: int = 8192, positions: int = 2048, d: int = 128, layers: int = 18,
                 heads: int = 4, ff: int = 512) -> None:
        super().__init__()
        self.word, self.pos = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.ln_emb = nn.LayerNorm(d)
        self.layers = nn.ModuleList(Layer(d, heads, ff) for _ in range(layers))
        self.pooler = nn.Linear(d, d)
        self.transform, self.ln_head = nn.Linear(d, d), nn.LayerNorm(d)
        self.decoder = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.ln_emb(self.word(ids) + self.pos(torch.arange(ids.shape[1])))
        for layer in self.layers:
            x = layer(x)
        x = x + torch.tanh(self.pooler(x[:, :1]))  # the pooled first token, added back
        return self.decoder(self.ln_head(F.gelu(self.transform(x))))


# ---- measurements ------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def rss_after_trim() -> int:
    """RSS after glibc hands its free heap pages back (malloc_trim): a diagnostic only, taken
    after the figures above, telling free-but-kept heap (fragmentation) from live memory.
    -1 where glibc is not the allocator."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return -1
    return rss_bytes()


def table_counts() -> Dict[str, int]:
    """The runtime's counts, the frontend's handle map and the output pool, on this rank."""
    counts = dict(basics.runtime_counts())
    counts["frontend_handle_map"] = len(submission._handle_map)
    counts["frontend_gpu_handles"] = len(submission._gpu_handles)
    counts["pool_outstanding"] = output_pool.pool.outstanding
    counts["pool_cached_blocks"] = output_pool.pool.cached_blocks
    counts["pool_cached_bytes"] = output_pool.pool.cached_bytes
    return counts


# Counts that grow legitimately until the working set is reached (the fusion buffer, the
# pool's cache) are judged by their own ratio or not at all; the rest must not grow.
_NOT_TABLES = ("fusion_buffer_bytes", "pool_cached_blocks", "pool_cached_bytes")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--steps", type=int, default=10_000, help="training steps (default 10000)")
    p.add_argument("--warmup-steps", type=int, default=500,
                   help="step after which the baseline RSS and counts are taken (default 500)")
    p.add_argument("--sample-every", type=int, default=500, help="RSS sample period in steps")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--layout", help="layout string for the JSON header, e.g. 1x2")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if not 0 < args.warmup_steps < args.steps:
        raise SystemExit("--warmup-steps must be between 0 and --steps")
    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = hvd.rank(), hvd.size()

    torch.manual_seed(args.seed)
    model = Model()
    params = list(model.parameters())
    assert len(params) == 300, len(params)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(FusedAdamW(model.parameters(), lr=1e-4, weight_decay=0.01),
                                   named_parameters=model.named_parameters())
    vocab = model.decoder.out_features
    data = torch.Generator().manual_seed(args.seed * 1000 + rank)

    step_times: List[float] = []
    rss_samples: List[List[int]] = []  # [step, bytes]
    mismatches = 0
    warm_rss, warm_counts = 0, {}
    for step in range(args.steps):
        start = time.perf_counter()
        ids = torch.randint(vocab, (args.batch, args.seq), generator=data)
        target = torch.randint(vocab, (args.batch, args.seq), generator=data)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ids).reshape(-1, vocab), target.reshape(-1))
        loss.backward()
        opt.step()
        hvd.allreduce(loss.detach(), name="loss")
        if step % 10 == 0:
            if step % 20 == 0:
                avg = hvd.grouped_allreduce([p.detach() for p in params], name="param_check")
            else:
                handles = [hvd.allreduce_async(p.detach(), name=f"param_check_async.{i}")
                           for i, p in enumerate(params)]
                avg = [hvd.synchronize(h) for h in handles]
            mismatches += sum(not torch.equal(a, p) for a, p in zip(avg, params))
            del avg
        if step % 100 == 0:
            stats = torch.tensor([[float(rank), float(step), loss.item(), 0.0]])
            hvd.allgather(stats, name="stats")
            hvd.broadcast_(torch.full((4,), float(step)), root_rank=0, name="lr_sync")
        step_times.append(time.perf_counter() - start)

        done = step + 1
        if done % args.sample_every == 0 or done == args.warmup_steps or done == args.steps:
            rss_samples.append([done, rss_bytes()])
        if done == args.warmup_steps:
            warm_rss, warm_counts = rss_bytes(), table_counts()
            warm_objects = len(gc.get_objects())
        if rank == 0 and done % 1000 == 0:
            print(f"# step {done}: rss {rss_bytes() / 2**20:.1f} MiB, "
                  f"median step {statistics.median(step_times[-1000:]) * 1e3:.2f} ms",
                  flush=True)

    # Everything was synchronized; let every rank's engine settle before reading its tables.
    hvd.barrier()
    end_rss, end_counts = rss_bytes(), table_counts()
    end_objects = len(gc.get_objects())
    trimmed_rss = rss_after_trim()
    growth = {k: end_counts[k] - warm_counts.get(k, 0) for k in end_counts}
    mine = {
        "rank": rank,
        "rss_warm_bytes": warm_rss, "rss_end_bytes": end_rss,
        "rss_growth_pct": 100.0 * (end_rss - warm_rss) / warm_rss,
        "rss_samples": rss_samples,
        "rss_end_after_malloc_trim_bytes": trimmed_rss,
        "counts_warm": warm_counts, "counts_end": end_counts,
        "leaked_handles": end_counts["open_handles"] + end_counts["frontend_handle_map"]
        + end_counts["frontend_gpu_handles"],
        "table_growth": sum(max(0, v) for k, v in growth.items() if k not in _NOT_TABLES),
        "pool_cached_growth": max(0, growth["pool_cached_blocks"]),
        "python_objects_warm": warm_objects, "python_objects_end": end_objects,
        "param_check_mismatches": mismatches,
        "step_times": (statistics.median(step_times), min(step_times), max(step_times)),
    }
    everyone = comm.gather(mine, root=0)
    if rank == 0:
        report(args, size, everyone, sum(step_times))
    hvd.shutdown()


def report(args: argparse.Namespace, size: int, ranks: List[Dict], total_s: float) -> None:
    import json
    machine = machine_info(size, args.layout)
    results = []
    for r in ranks:
        med, lo, hi = r.pop("step_times")
        results.append({"name": f"soak_step_rank{r['rank']}",
                        "params": {"steps": args.steps, "warmup_steps": args.warmup_steps,
                                   "tensors": 300, "batch": args.batch, "seq": args.seq, **r},
                        "median_s": med, "min_s": lo, "max_s": hi, "reps": args.steps})
    ratios = {
        "rss_growth_pct": max(r["rss_growth_pct"] for r in ranks),
        "leaked_handles": sum(r["leaked_handles"] for r in ranks),
        "runtime_table_growth": sum(r["table_growth"] for r in ranks),
        "pool_cached_growth": sum(r["pool_cached_growth"] for r in ranks),
    }
    print("# soak_bench")
    print("# machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    print(f"# {args.steps} steps of 300 tensors, baseline after step {args.warmup_steps}; "
          f"rank 0 ran {total_s:.1f} s of steps")
    print(f"{'rank':>4} {'step median ms':>15} {'min ms':>8} {'max ms':>8} {'RSS warm MiB':>13} "
          f"{'RSS end MiB':>12} {'growth %':>9} {'leaked':>7} {'tables+':>8} {'mismatch':>9}")
    for row, r in zip(results, ranks):
        print(f"{r['rank']:>4} {row['median_s'] * 1e3:>15.2f} {row['min_s'] * 1e3:>8.2f} "
              f"{row['max_s'] * 1e3:>8.2f} {r['rss_warm_bytes'] / 2**20:>13.1f} "
              f"{r['rss_end_bytes'] / 2**20:>12.1f} {r['rss_growth_pct']:>9.3f} "
              f"{r['leaked_handles']:>7} {r['table_growth']:>8} {r['param_check_mismatches']:>9}")
    for r in ranks:
        print(f"# rank {r['rank']} counts at the end: {r['counts_end']}")
        print(f"# rank {r['rank']} RSS MiB by step: "
              + ", ".join(f"{s}:{b / 2**20:.1f}" for s, b in r["rss_samples"])
              + f"; after malloc_trim: {r['rss_end_after_malloc_trim_bytes'] / 2**20:.1f}; "
              f"Python objects {r['python_objects_warm']} -> {r['python_objects_end']}")
    print("ratios (lower is better; targets: rss_growth_pct < 1, the others 0):")
    for k, v in ratios.items():
        print(f"  {k} = {v:.3f}" if isinstance(v, float) else f"  {k} = {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "soak_bench", "machine": machine, "results": results,
                       "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()
