"""The advisor's accuracy and run time on the emulated cluster (issue 31).

For each layout (``--layouts 2x2@1,2x2@5,4x1@1``: nodes x ranks per node @ Gbit/s), inside an
emulated cluster (aiak_training.testing.cluster; needs root):

1. ``aiakrun --advise -np N python advise_bench.py --worker``: the advisor's predicted step
   time for every configuration, and the advisor's own run time;
2. ``aiakrun -np N --allreduce-algo ALGO python advise_bench.py --worker --measure OUT``, for
   every algorithm of the layout, ``--rounds`` times in turn (A B C A B C): the measured step
   time of the four variants (overlap_update x fused optimizer), timed alternately in the
   same launch, each on its own copy of the model.

The model is the e2e MLP of benchmarks/ (3072-1024-1024-1024-10, 5.26M parameters) with Adam,
32 random samples per rank and step.

Ratios (``<layout>`` is e.g. ``2x2_1gbit``):

  advise_error_median_<layout>   median over lossless configurations of
                                 |predicted - measured| / measured.  Target <= 0.15.
  advise_error_worst_<layout>    the largest of those.  Target <= 0.30.
  advise_best_first_<layout>     1 if the advisor's recommendation is the measured fastest
                                 configuration (or within 3% of it), else 0.  Target 1.
  advise_seconds_<layout>        the advisor's run time, seconds.  Target <= 60 (e2e MLP, 2x2).

Usage (root)::

    python benchmarks/advise_bench.py --layouts 2x2@1,2x2@5,4x1@1 --json advise.json
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ME = os.path.abspath(__file__)
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (overlap, fused)


def _name(algo: str, overlap: bool, fused: bool) -> str:
    return "+".join([algo] + [x for x, on in (("overlap", overlap), ("fused", fused)) if on])


def _mlp():
    import torch
    return torch.nn.Sequential(torch.nn.Linear(3072, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10))


def worker(args) -> None:
    """A rank: train (for the advisor) or time the four variants (--measure)."""
    import torch

    import aiak_training.torch as hvd
    from aiak_training.fused_optim import FusedAdam
    torch.manual_seed(0)
    hvd.init()
    x, y = torch.randn(32, 3072), torch.randint(0, 10, (32,))
    if not args.measure:
        model = _mlp()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters())
        for _ in range(1000):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return
    runs = []
    for i, (overlap, fused) in enumerate(VARIANTS):
        model = _mlp()
        base = (FusedAdam if fused else torch.optim.Adam)(model.parameters(), lr=1e-3)
        named = [(f"v{i}.{n}", p) for n, p in model.named_parameters()]
        runs.append((model, hvd.DistributedOptimizer(base, named_parameters=named,
                                                     overlap_update=overlap)))

    def steps(model, opt, n: int) -> float:
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - start) / n

    samples: Dict[int, List[float]] = {i: [] for i in range(len(runs))}
    for rnd in range(args.warmup + args.reps):
        for i, (model, opt) in enumerate(runs):
            t = steps(model, opt, args.steps)
            if rnd >= args.warmup:
                samples[i].append(t)
    if hvd.rank() == 0:
        with open(args.measure, "w") as f:
            json.dump({_name(args.algo, *VARIANTS[i]): s for i, s in samples.items()}, f)
    hvd.shutdown()


def _layout(text: str) -> Tuple[int, int, float]:
    shape, _, rate = text.partition("@")
    nodes, rpn = shape.split("x")
    return int(nodes), int(rpn), float(rate or 1)


def _run(cluster, argv: List[str], env: Dict[str, str], timeout: float) -> str:
    proc = cluster.run(argv, timeout=timeout, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def bench_layout(args, layout: str, tmp: str) -> Tuple[List[Dict], Dict[str, float], Dict]:
    from aiak_training.testing.cluster import EmulatedCluster
    from bench_common import child_env, machine_info, read_json, summarize
    nodes, rpn, rate = _layout(layout)
    key = f"{nodes}x{rpn}_{rate:g}gbit"
    n = nodes * rpn
    env = child_env(REPO)
    algos = ["flat"] + (["hier_staged", "hier_pipelined"] if nodes > 1 and rpn > 1 else [])
    with EmulatedCluster(nodes=nodes, ranks_per_node=rpn, rate_gbit=rate) as cluster:
        pred_path = os.path.join(tmp, f"{key}_advise.json")
        table = _run(cluster, ["aiakrun", "--advise", "-np", str(n), sys.executable, ME,
                               "--worker"], {**env, "AIAK_ADVISE_JSON": pred_path}, 300)
        print(table, flush=True)
        pred = read_json(pred_path)
        measured: Dict[str, List[float]] = {}
        for rnd in range(args.rounds):
            for algo in algos:
                out = os.path.join(tmp, f"{key}_{algo}_{rnd}.json")
                _run(cluster, ["aiakrun", "-np", str(n), "--allreduce-algo", algo,
                               sys.executable, ME, "--worker", "--measure", out, "--algo", algo,
                               "--reps", str(args.reps), "--steps", str(args.steps)], env, 600)
                for name, s in read_json(out).items():
                    measured.setdefault(name, []).extend(s)
        machine = machine_info(ranks=n, layout=f"{nodes}x{rpn}",
                               link_gbit=cluster.measured_gbit or rate)
    predicted = {r["name"]: r["step_s"] for r in pred["rows"] if r["lossless"]}
    results, errors = [], {}
    for name, samples in measured.items():
        res = summarize(name, {"layout": layout, "predicted_s": predicted[name]}, samples)
        errors[name] = abs(predicted[name] - res["median_s"]) / res["median_s"]
        res["params"]["error"] = errors[name]
        results.append(res)
    fastest = min(results, key=lambda r: r["median_s"])
    chosen = [r for r in results if r["name"] == pred["recommended"]][0]
    ratios = {f"advise_error_median_{key}": statistics.median(errors.values()),
              f"advise_error_worst_{key}": max(errors.values()),
              f"advise_best_first_{key}": float(chosen["median_s"] <= 1.03 * fastest["median_s"]),
              f"advise_seconds_{key}": pred["seconds"]}
    extra = {"recommended": pred["recommended"], "measured_fastest": fastest["name"],
             "net_bw": pred["net"]["bw"], "net_lat": pred["net"]["lat"], "op_s": pred.get("op_s")}
    return results, ratios, {"machine": machine, **extra}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--algo", default="flat", help=argparse.SUPPRESS)
    p.add_argument("--layouts", default="2x2@1,2x2@5,4x1@1")
    p.add_argument("--rounds", type=int, default=2, help="launches per algorithm, in turn")
    p.add_argument("--reps", type=int, default=5, help="timed rounds per launch (>= 5)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="steps per timed sample")
    p.add_argument("--json")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.reps < 5:
        raise SystemExit("--reps must be >= 5 (BENCHMARKS.md)")
    from bench_common import report
    tmp = tempfile.mkdtemp(prefix="advise_bench.")
    os.chmod(tmp, 0o777)
    all_results, all_ratios, runs = [], {}, {}
    for layout in args.layouts.split(","):
        results, ratios, extra = bench_layout(args, layout, tmp)
        all_results += results
        all_ratios.update(ratios)
        runs[layout] = extra
        report("advise_bench", extra["machine"], results, ratios, None)
        print(json.dumps({k: v for k, v in extra.items() if k != "machine"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "advise_bench", "machine": runs, "results": all_results,
                       "ratios": all_ratios}, f, indent=2)


if __name__ == "__main__":
    main()
