"""Autotune vs the default settings: step throughput of a real training job.

One launch per case.  The job trains with ``HOROVOD_AUTOTUNE=1`` (default autotune options)
until tuning ends, then times blocks of steps at the chosen setting and at the default
setting (fusion 128 MB, cycle 1 ms, the algorithm ``auto`` picks), alternately A B A B,
switching every rank at the same step boundary the way autotune does.  Cases:

  small   an MLP of 100 Linear(90, 90) layers: 200 gradient tensors, each under 64 KB
  e2e     the e2e MLP of benchmarks/ (3072-1024-1024-1024-10, 5.26M parameters)

Both with Adam and DistributedOptimizer, batch 32 per rank.  Run on the emulated 2 nodes x 2
ranks cluster at 1 Gbit/s (root)::

    python -m aiak_training.testing.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        sh -c 'mpiexec -n 4 python benchmarks/autotune_bench.py --case small \\
               --json benchmarks/results/autotune_small_2x2_1gbit.json'

Ratios (above 1 means autotune is better):

  autotune_vs_default_<case>   median steps/s at the tuned setting / median steps/s at the
                               default setting, blocks interleaved.  Target >= 1.0.
  autotune_steps_<case>        steps until tuning ended (a count, not a ratio).  Target <= 300.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import link_gbit, machine_info, report, summarize  # noqa: E402

os.environ.setdefault("HOROVOD_AUTOTUNE", "1")
import aiak_training.torch as hvd  # noqa: E402
from aiak_training.allreduce import resolve_algorithm  # noqa: E402
from aiak_training.runtime import autotune, current  # noqa: E402
from aiak_training.runtime.autotune.knobs import (  # noqa: E402
    Setting, apply_setting, current_setting)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=("small", "e2e"), required=True)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=7, help="timed blocks per setting (>= 5)")
    p.add_argument("--block", type=int, default=10, help="steps per timed block")
    p.add_argument("--max-tuning-steps", type=int, default=400)
    p.add_argument("--link-gbit", type=float, help="link rate to record (default: the "
                   "emulated cluster's, when it says)")
    return p.parse_args(argv)


def build_model(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if case == "small":
        return torch.nn.Sequential(*[torch.nn.Linear(90, 90) for _ in range(100)])
    return torch.nn.Sequential(torch.nn.Linear(3072, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10))


def main() -> None:
    args = parse_args()
    if args.reps < 5:
        raise SystemExit("--reps must be at least 5")
    hvd.init()
    engine = current.engine()
    model = build_model(args.case)
    width = 90 if args.case == "small" else 3072
    data = torch.randn(32, width)
    target = torch.randn(32, 90) if args.case == "small" else torch.randint(0, 10, (32,))
    loss_fn = torch.nn.MSELoss() if args.case == "small" else torch.nn.CrossEntropyLoss()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step():
        opt.zero_grad()
        loss_fn(model(data), target).backward()
        opt.step()

    steps = 0
    while autotune.tuning() and steps < args.max_tuning_steps:
        step()
        steps += 1
    # The step in which tuning ended ran at the chosen setting: it is not counted.
    tuning_steps = steps - 1 if not autotune.tuning() else None
    tuned = current_setting(engine)
    cfg = engine.config
    default_algo = resolve_algorithm(cfg.__class__(), engine.topology, is_global=True)[0]
    default = Setting(128 * 1024 * 1024, 1.0, default_algo if default_algo in engine.algorithms
                      else tuned.algorithm, tuned.cache_enabled)
    times = {"default": [], "autotune": []}
    for rep in range(args.reps + 1):  # the first round is warm-up
        for name, setting in (("default", default), ("autotune", tuned)):
            hvd.barrier()             # nothing in flight: every rank switches here
            apply_setting(engine, setting)
            step()
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                step()
            hvd.barrier()
            if rep:
                times[name].append((time.perf_counter() - start) / args.block)
    if hvd.rank() == 0:
        layout = f"{hvd.cross_size()}x{hvd.local_size()}"
        machine = machine_info(ranks=hvd.size(), layout=layout,
                               link_gbit=link_gbit(args.link_gbit))
        machine.update(case=args.case, tuned=tuned.describe(), default=default.describe())
        results = [summarize(f"{name} step", {"setting": s.describe()}, times[name])
                   for name, s in (("default", default), ("autotune", tuned))]
        ratios = {f"autotune_vs_default_{args.case}":
                  statistics.median(times["default"]) / statistics.median(times["autotune"]),
                  f"autotune_steps_{args.case}": float(tuning_steps or -1)}
        report("autotune_bench", machine, results, ratios, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
