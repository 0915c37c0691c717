"""Overlapped parameter update: DistributedOptimizer step time, synchronous vs overlapped.

One training iteration (zero_grad, forward, backward, step) of an MLP with about 25M fp32
parameters in 168 tensors (42 blocks of Linear(768, 768) + LayerNorm), with torch.optim.Adam,
so the optimizer update is a real share of the step.  The same model and data are trained by
two DistributedOptimizers in the same launch, timed alternately A B A B after warm-up:

  sync     overlap_update=False: step() = synchronize() (wait for every allreduce), then
           Adam over all parameters.  Timed as synchronize() + skip_synchronize() step() so
           the update time of the synchronous path is known too.
  overlap  overlap_update=True: step() updates each bucket as soon as its allreduce is done.

Each timed sample is the slowest rank's iteration (barrier before and after).  Run it once on
the emulated 2 nodes x 2 ranks cluster at 1 Gbit/s and once on one node at 2 ranks::

    export HOROVOD_FUSION_THRESHOLD=16777216   # several buckets per step; see RESULTS.md
    python -m aiak_training.testing.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        sh -c 'mpiexec -n 4 python benchmarks/overlap_bench.py --json overlap_1gbit.json'
    mpiexec -n 2 python benchmarks/overlap_bench.py --json overlap_local.json

or let this script launch both and merge the JSON (root, for the cluster tool; the environment,
HOROVOD_FUSION_THRESHOLD included, reaches the ranks)::

    python benchmarks/overlap_bench.py --launch all --json overlap.json

The fusion threshold in effect is recorded in the JSON (machine.fusion_threshold_bytes).

Ratios (above 1 means aiak-training is better):

  overlap_step_speedup_1gbit   on the emulated cluster (key from the nominal link rate,
                               "_<N>gbit"): median sync iteration time / median overlapped
                               iteration time.  Target >= 1.15.
  overlap_step_speedup_local   the same without emulation (ranks on one node).  Target >= 1.0.
  hidden_update_fraction[_local]  of the time the overlapped steps spent in Adam updates, the
                               fraction that ran before the step's last allreduce completed
                               (engine completion timestamps, averaged over ranks): update
                               work hidden behind communication.  Target >= 0.7 (1 Gbit/s).
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=9, help="timed iterations per variant (>= 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per variant")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=42, help="blocks of Linear + LayerNorm")
    p.add_argument("--batch", type=int, default=16, help="samples per rank")
    p.add_argument("--optimizer", choices=["adam", "fused_adam"], default="adam")
    p.add_argument("--network", choices=["auto", "emulated", "local"], default="auto",
                   help="names the ratio keys; auto: emulated inside the cluster tool")
    p.add_argument("--launch", choices=["local", "emulated", "all"],
                   help="launch the benchmark (mpiexec; the cluster tool for emulated) and "
                        "merge the JSON instead of running as a rank")
    p.add_argument("--nranks-local", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="--launch: emulated link rate")
    return p.parse_args(argv)


# ---- the model ------------------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.fc(x)))


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(width) for _ in range(depth)])


def make_optimizer(kind: str, params):
    if kind == "fused_adam":
        from aiak_training.fused_optim import FusedAdam
        return FusedAdam(params, lr=1e-4, weight_decay=1e-4)
    return torch.optim.Adam(params, lr=1e-4, weight_decay=1e-4)


# ---- one rank --------------------------------------------------------------------------------
def run_rank(args) -> None:
    import aiak_training.torch as hvd
    from aiak_training.runtime import current
    from bench_common import interleave, link_gbit, machine_info, report, summarize

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # Read what the report needs from the engine now: once the last collective is done, a peer
    # that reaches hvd.shutdown() first shuts this rank's engine down too, and
    # current.engine() then raises "Horovod has not been initialized".
    engine = current.engine()
    topo = engine.topology
    fusion_threshold = engine.config.fusion_threshold
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)

    variants = {}
    opts = {}
    step_times = {"sync": [], "overlap": []}
    sync_parts = {"wait": [], "update": []}
    for name, overlap in (("sync", False), ("overlap", True)):
        model = make_model(args.width, args.depth)
        opt = hvd.DistributedOptimizer(make_optimizer(args.optimizer, model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       overlap_update=overlap)
        opts[name] = opt

        def iteration(model=model, opt=opt, name=name):
            hvd.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            t_bwd = time.perf_counter()
            if name == "sync":
                opt.synchronize()
                t_sync = time.perf_counter()
                with opt.skip_synchronize():
                    opt.step()
                t_end = time.perf_counter()
                sync_parts["wait"].append(t_sync - t_bwd)
                sync_parts["update"].append(t_end - t_sync)
            else:
                opt.step()
                t_end = time.perf_counter()
            step_times[name].append(t_end - t_bwd)
            hvd.barrier()
            return time.perf_counter() - start
        variants[name] = iteration

    for _ in range(args.warmup):
        for fn in variants.values():
            fn()
    for lst in list(step_times.values()) + list(sync_parts.values()):
        lst.clear()
    before = opts["overlap"].overlap_stats()
    times = interleave(variants, reps=args.reps, warmup=0)
    after = opts["overlap"].overlap_stats()
    delta = {k: after[k] - before[k] for k in ("update_s", "hidden_update_s", "wait_s",
                                              "buckets", "overlapped_steps", "param_updates")}
    # Average the per-rank counters (each rank's own update work and engine timestamps).
    counters = torch.tensor([delta["update_s"], delta["hidden_update_s"], delta["buckets"],
                             sum(sync_parts["update"])], dtype=torch.float64)
    counters = hvd.allreduce(counters, op=hvd.Average, name="overlap_bench.counters")
    upd, hidden, buckets, sync_upd = counters.tolist()
    hidden_fraction = hidden / upd if upd > 0 else 0.0

    nominal = os.environ.get("AIAK_CLUSTER_NOMINAL_GBIT")
    network = args.network
    if network == "auto":
        network = "emulated" if os.environ.get("AIAK_CLUSTER_NODES") else "local"
    if network == "emulated":
        suffix = f"_{nominal or '1'}gbit"
    else:
        suffix = "_local"
    layout = (f"{topo.num_nodes}x{topo.node_sizes[0]}" if topo.is_homogeneous
              else "+".join(str(n) for n in topo.node_sizes))
    link = link_gbit()
    if rank == 0:
        import statistics
        nparams = sum(p.numel() for p in opts["sync"].param_groups[0]["params"])
        ntensors = len(opts["sync"].param_groups[0]["params"])
        common = {"params": nparams, "tensors": ntensors, "optimizer": args.optimizer,
                  "batch_per_rank": args.batch,
                  "fusion_threshold_bytes": fusion_threshold}
        results = [
            summarize("iteration sync (overlap_update=False)", dict(common), times["sync"]),
            summarize("iteration overlap (overlap_update=True)", dict(common), times["overlap"]),
            summarize("step() sync, rank 0", dict(common), step_times["sync"]),
            summarize("  of which synchronize(), rank 0", dict(common), sync_parts["wait"]),
            summarize("  of which Adam update, rank 0", dict(common), sync_parts["update"]),
            summarize("step() overlap, rank 0", dict(common, buckets_per_step=buckets / args.reps),
                      step_times["overlap"]),
        ]
        ratios = {
            f"overlap_step_speedup{suffix}": (statistics.median(times["sync"])
                                              / statistics.median(times["overlap"])),
            "hidden_update_fraction" + ("" if network == "emulated" else "_local"): hidden_fraction,
        }
        machine = machine_info(size, layout, link)
        if nominal:
            machine["link_nominal_gbit"] = float(nominal)
        machine["fusion_threshold_bytes"] = common["fusion_threshold_bytes"]
        report("overlap_bench", machine, results, ratios, None)
        # Context for the hidden fraction: the synchronous path's update time per step, and
        # the overlapped path's update time per step, exposed and hidden (means over ranks).
        extra = {"sync_update_s_per_step": sync_upd / args.reps,
                 "overlap_update_s_per_step": upd / args.reps,
                 "overlap_hidden_update_s_per_step": hidden / args.reps,
                 "overlap_exposed_update_s_per_step": (upd - hidden) / args.reps,
                 "buckets_per_step": buckets / args.reps}
        for k, v in extra.items():
            print(f"  {k} = {v:.4f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "overlap_bench", "machine": machine, "results": results,
                           "ratios": ratios, "extra": extra}, f, indent=2)
    hvd.shutdown()


# ---- launcher ---------------------------------------------------------------------------------
def launch(args) -> int:
    """Run the local and/or emulated configurations and merge their JSON."""
    from bench_common import child_env, run_json_job
    me = os.path.abspath(__file__)
    passthrough = ["--reps", str(args.reps), "--warmup", str(args.warmup), "--width",
                   str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
                   "--optimizer", args.optimizer]
    env = child_env(REPO)
    merged = None
    tmp = tempfile.mkdtemp(prefix="overlap_bench.")
    configs = ["emulated", "local"] if args.launch == "all" else [args.launch]
    for config in configs:
        out = os.path.join(tmp, f"{config}.json")
        if config == "local":
            cmd = ["mpiexec", "-n", str(args.nranks_local), sys.executable, me, "--network",
                   "local", "--json", out] + passthrough
        else:
            inner = " ".join(["mpiexec", "-n", "4", sys.executable, me, "--network", "emulated",
                              "--json", out] + passthrough)
            cmd = [sys.executable, "-m", "aiak_training.testing.cluster", "--nodes", "2",
                   "--ranks-per-node", "2", "--rate", args.rate, "--", "sh", "-c", inner]
        data = run_json_job([cmd], out, config, env=env, cwd=REPO, stream=True)
        if merged is None:
            merged = {"benchmark": "overlap_bench", "runs": [], "ratios": {}}
        merged["runs"].append({"config": config, **data})
        merged["ratios"].update(data["ratios"])
    print("merged ratios:", json.dumps(merged["ratios"], indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(merged, f, indent=2)
    return 0


def main() -> None:
    args = parse_args()
    if args.reps < 5:
        raise SystemExit("--reps must be >= 5 (BENCHMARKS.md)")
    if args.launch:
        sys.exit(launch(args))
    run_rank(args)


if __name__ == "__main__":
    main()
