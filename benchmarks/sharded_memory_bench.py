"""Peak memory of sharded optimizer state (issue 32): ``sharded_peak_rss_saving``.

A 50.4M-parameter MLP (12 layers 2048 x 2048, then 2048 x 10; fp32) trained with
torch.optim.Adam for --steps steps by the dense DistributedOptimizer and, in another launch, by
``shard_optimizer_state=True``.  A process's peak RSS cannot be reset for a second variant,
so every rep launches ``mpiexec -n N`` twice, once per variant (the order alternates from rep
to rep), and each rank reports its own high-water mark (``ru_maxrss``).

Ratios (rank 0's JSON; "peak" is the largest over ranks, median over --reps launches):

  sharded_peak_rss_saving      (peak RSS dense - peak RSS sharded) / (Adam state bytes a rank
                               holds dense - the most a rank holds sharded): the fraction of
                               the state bytes that sharding removes from a rank which the
                               rank's peak RSS really saves.  Target >= 0.7.
  sharded_peak_rss_saving_of_dense_state
                               the same saving / the dense state bytes (8 bytes a parameter);
                               at most 1 - 1/N, reported beside the target.
  sharded_peak_rss_fraction    peak RSS sharded / peak RSS dense (cost).

    python benchmarks/sharded_memory_bench.py --ranks 2 --reps 5 --json PATH

The target is met with default settings, whose gradients are bounded;
AIAK_SHARD_GRADIENTS=kept (one gradient buffer per bucket, kept: the faster mode; ``flat`` is
its older name) measures the other mode.  The environment passes to the ranks:
AIAK_OUTPUT_POOL_BYTES=0 (no pool of freed collective results) and
MALLOC_MMAP_THRESHOLD_=1048576 (glibc unmaps freed blocks of 1 MiB or more) show what each
variant needs apart from memory kept for reuse.  The dense peak varies by up to ~100 MiB from
launch to launch (where glibc places the freed gradients), so use 5 reps or more.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, mpiexec, run_json_job  # noqa: E402

VARIANTS = ("dense", "sharded")
# Settings that change how much freed memory a process keeps (recorded with the figures).
ENV_KNOBS = ("AIAK_OUTPUT_POOL_BYTES", "MALLOC_MMAP_THRESHOLD_", "AIAK_SHARD_BUCKET_BYTES",
             "AIAK_SHARD_GRADIENTS")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="launches per variant (>= 3)")
    p.add_argument("--steps", type=int, default=3, help="training steps per launch")
    p.add_argument("--width", type=int, default=2048, help="hidden width")
    p.add_argument("--layers", type=int, default=12, help="width x width layers")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def peak_rss() -> int:
    """This process's peak resident set size so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args: argparse.Namespace) -> None:
    """One rank of one launch: train, then rank 0 writes every rank's figures to --out."""
    import torch

    import aiak_training.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = args.width
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(w, w), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(w, 10))
    params = sum(p.numel() for p in model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                   named_parameters=model.named_parameters(),
                                   shard_optimizer_state=args.worker == "sharded")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(8, w), torch.randint(0, 10, (8,))
    before = peak_rss()
    for _ in range(args.steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    mine = {"rank": hvd.rank(), "peak_rss": peak_rss(), "peak_before": before,
            "state_bytes": state, "params": params}
    every = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)


def launch(variant: str, args: argparse.Namespace, out: str) -> List[Dict]:
    """Run one ``mpiexec -n ranks`` launch of ``variant``; every rank's figures."""
    cmd = [mpiexec(), "-n", str(args.ranks), sys.executable, os.path.abspath(__file__),
           "--worker", variant, "--out", out, "--steps", str(args.steps),
           "--width", str(args.width), "--layers", str(args.layers)]
    return run_json_job([cmd], out, f"{variant} launch", timeout=900)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    peaks: Dict[str, List[int]] = {v: [] for v in VARIANTS}
    state: Dict[str, int] = {}
    params = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                ranks = launch(variant, args, os.path.join(tmp, f"{variant}{rep}.json"))
                peaks[variant].append(max(r["peak_rss"] for r in ranks))
                # The most state any rank holds (every rank holds the same when dense).
                state[variant] = max(r["state_bytes"] for r in ranks)
                params = ranks[0]["params"]
                print(f"# rep {rep} {variant}: peak RSS per rank (MiB) "
                      + ", ".join(f"{r['peak_rss'] / 2**20:.1f}" for r in ranks)
                      + f"; peak before training {ranks[0]['peak_before'] / 2**20:.1f}; "
                      f"state {state[variant] / 2**20:.1f}", flush=True)
    med = {v: statistics.median(peaks[v]) for v in VARIANTS}
    saved = med["dense"] - med["sharded"]
    ratios = {
        "sharded_peak_rss_saving": saved / (state["dense"] - state["sharded"]),
        "sharded_peak_rss_saving_of_dense_state": saved / state["dense"],
        "sharded_peak_rss_fraction": med["sharded"] / med["dense"],
    }
    env = {k: os.environ[k] for k in ENV_KNOBS if k in os.environ}
    results = [{"name": f"mlp_{v}", "params": {"parameters": params, "ranks": args.ranks,
                                               "steps": args.steps, "state_bytes": state[v],
                                               "env": env},
                "median_peak_rss_bytes": med[v], "min_peak_rss_bytes": min(peaks[v]),
                "max_peak_rss_bytes": max(peaks[v]), "reps": len(peaks[v])}
               for v in VARIANTS]
    machine = machine_info(ranks=args.ranks)
    print("# sharded_memory_bench")
    print("# machine: " + ", ".join(f"{k}={val}" for k, val in machine.items()))
    print(f"# {params:,} parameters, Adam, {args.ranks} ranks, {args.steps} steps; {env}")
    print(f"{'variant':<20} {'peak MiB (median)':>18} {'min':>8} {'max':>8} {'state MiB':>10}")
    for r in results:
        print(f"{r['name']:<20} {r['median_peak_rss_bytes'] / 2**20:>18.1f} "
              f"{r['min_peak_rss_bytes'] / 2**20:>8.1f} {r['max_peak_rss_bytes'] / 2**20:>8.1f} "
              f"{r['params']['state_bytes'] / 2**20:>10.1f}")
    for k, v in ratios.items():
        print(f"  {k} = {v:.3f}")
    print("# target: sharded_peak_rss_saving >= 0.7")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "sharded_memory_bench", "machine": machine,
                       "results": results, "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()
