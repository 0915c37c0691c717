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

With ``--grid`` the same launch also runs Horovod users' hand grid: fusion threshold 4, 32
and 128 MB x cycle time 1, 5 and 25 ms x every allreduce algorithm the layout allows (27
points on 2x2 over MPI), response cache on.  First a screening pass: ``--grid-reps`` rounds,
each timing a block of ``--grid-block`` steps at every grid point and at the tuned setting,
in turn.  The grid point with the lowest median block time is the best of the grid; it then
joins the A/B blocks above as a third arm (default, autotune, best of grid, interleaved), so
that the final comparison is not the screening's minimum of 27 noisy medians.

Ratios (above 1 means autotune is better):

  autotune_vs_default_<case>     median steps/s at the tuned setting / median steps/s at the
                                 default setting, blocks interleaved.  Target >= 1.0.
  autotune_vs_best_grid_<case>   (--grid) the same against the best point of the hand grid,
                                 from the interleaved blocks.  Target >= 0.95.
  autotune_vs_best_grid_screen_<case>  (--grid) the screening pass's figure: the best grid
                                 point's median block time / the tuned setting's, same rounds.
  autotune_steps_<case>          steps until tuning ended (a count, not a ratio).
                                 Target <= 300.
"""
import argparse
import os
import statistics
import sys
import time
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import link_gbit, machine_info, report, summarize  # noqa: E402

os.environ.setdefault("HOROVOD_AUTOTUNE", "1")
import aiak_training.torch as hvd  # noqa: E402
from aiak_training.allreduce import resolve_algorithm  # noqa: E402
from aiak_training.runtime import autotune, current  # noqa: E402
from aiak_training.runtime.autotune.knobs import (  # noqa: E402
    MB, Setting, apply_setting, current_setting)

GRID_FUSION_MB = (4, 32, 128)
GRID_CYCLE_MS = (1.0, 5.0, 25.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=("small", "e2e"), required=True)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=7, help="timed blocks per setting (>= 5)")
    p.add_argument("--block", type=int, default=10, help="steps per timed block")
    p.add_argument("--max-tuning-steps", type=int, default=400)
    p.add_argument("--grid", action="store_true", help="also run the 27-point hand grid")
    p.add_argument("--grid-reps", type=int, default=5, help="screening rounds (>= 5)")
    p.add_argument("--grid-block", type=int, default=5, help="steps per screening block")
    p.add_argument("--link-gbit", type=float, help="link rate to record (default: the "
                   "emulated cluster's, when it says)")
    return p.parse_args(argv)


def grid_points(algorithms: List[str], default: Setting) -> List[Setting]:
    """The hand grid: fusion 4, 32, 128 MB x cycle 1, 5, 25 ms x ``algorithms``."""
    return [Setting(mb * MB, ms, algo, default.cache_enabled)
            for algo in algorithms for mb in GRID_FUSION_MB for ms in GRID_CYCLE_MS]


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
    if args.reps < 5 or (args.grid and args.grid_reps < 5):
        raise SystemExit("--reps and --grid-reps must be at least 5")
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
    default = Setting(128 * MB, 1.0, default_algo if default_algo in engine.algorithms
                      else tuned.algorithm, cfg.cache_capacity > 0)

    def block(setting: Setting, steps: int) -> float:
        """Seconds per step of ``steps`` steps at ``setting``, after one step to switch."""
        hvd.barrier()                 # nothing in flight: every rank switches here
        apply_setting(engine, setting)
        step()
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        hvd.barrier()
        return (time.perf_counter() - start) / steps

    arms = [("default", default), ("autotune", tuned)]
    screen, points = {}, []
    if args.grid:
        points = grid_points(list(engine.algorithms) or [tuned.algorithm], default)
        screen = {s: [] for s in points + [tuned]}
        for _ in range(args.grid_reps):
            for setting in screen:
                screen[setting].append(block(setting, args.grid_block))
        best = min(points, key=lambda s: statistics.median(screen[s]))
        arms.append(("best_grid", best))
    times = {name: [] for name, _ in arms}
    for rep in range(args.reps + 1):  # the first round is warm-up
        for name, setting in arms:
            t = block(setting, args.block)
            if rep:
                times[name].append(t)
    if hvd.rank() == 0:
        layout = f"{hvd.cross_size()}x{hvd.local_size()}"
        machine = machine_info(ranks=hvd.size(), layout=layout,
                               link_gbit=link_gbit(args.link_gbit))
        machine.update(case=args.case, tuned=tuned.describe(), default=default.describe())
        results = [summarize(f"{name} step", {"setting": s.describe()}, times[name])
                   for name, s in arms]
        results += [summarize("grid screen step", {"setting": s.describe(),
                                                    "tuned": s == tuned}, t)
                    for s, t in screen.items()]
        tuned_s = statistics.median(times["autotune"])
        ratios = {f"autotune_vs_default_{args.case}":
                  statistics.median(times["default"]) / tuned_s,
                  f"autotune_steps_{args.case}": float(tuning_steps or -1)}
        if args.grid:
            machine.update(best_grid=arms[2][1].describe(), grid_points=len(points),
                           grid_algorithms=sorted({s.algorithm for s in points}))
            ratios[f"autotune_vs_best_grid_{args.case}"] = \
                statistics.median(times["best_grid"]) / tuned_s
            ratios[f"autotune_vs_best_grid_screen_{args.case}"] = \
                statistics.median(screen[arms[2][1]]) / statistics.median(screen[tuned])
        report("autotune_bench", machine, results, ratios, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
