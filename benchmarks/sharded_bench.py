"""Sharded optimizer state (shard_optimizer_state=True, issue 32): state bytes and step time.

Two parameter sets, each trained with Adam (or --optimizer) by a dense DistributedOptimizer
and by a sharded one, in the same launch:

  mlp       the e2e MLP of benchmarks/ (3072-1024-1024-1024-10, 5.26M parameters), forward and
            backward on a random batch of 32;
  resnet50  the ResNet-50 parameter set (161 tensors, 25.6M elements), loss = sum(w * c) for
            a fixed random c, so backward is cheap and the step dominates.

Run with mpiexec -n N (N = 2, 4).  Each timed sample is the slowest rank's iteration
(zero_grad, forward, backward, step; barrier before and after), dense and sharded alternating
after warm-up.

Ratios:

  sharded_state_bytes_fraction_<set>   the largest optimizer-state byte count a rank holds
                                       with sharding / the dense optimizer's (the same on every
                                       rank).  Target <= 1/N + 0.05.
  sharded_vs_dense_step_<set>          median dense iteration time / median sharded iteration
                                       time (above 1: sharded faster).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import interleave, machine_info, report, resnet50_shapes, summarize, timed  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=7, help="timed iterations per variant (>= 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sets", default="mlp,resnet50")
    p.add_argument("--optimizer", choices=("adam", "fused_adam"), default="adam")
    return p.parse_args(argv)


def build(which, seed=0):
    """(module, run forward+backward)."""
    torch.manual_seed(seed)
    if which == "mlp":
        net = torch.nn.Sequential(torch.nn.Linear(3072, 1024), torch.nn.ReLU(),
                                  torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                  torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                  torch.nn.Linear(1024, 10))
        x, y = torch.randn(32, 3072), torch.randint(0, 10, (32,))

        def fwd_bwd():
            torch.nn.functional.cross_entropy(net(x), y).backward()
        return net, fwd_bwd
    net = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s) * 0.01)
                                  for s in resnet50_shapes()])
    coef = [torch.randn(s) for s in resnet50_shapes()]

    def fwd_bwd():
        sum((w * c).sum() for w, c in zip(net, coef)).backward()
    return net, fwd_bwd


def state_bytes(opt):
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def main(argv=None):
    args = parse_args(argv)
    import aiak_training.torch as hvd
    from aiak_training.fused_optim import FusedAdam
    hvd.init()
    n = hvd.size()
    make_inner = {"adam": torch.optim.Adam, "fused_adam": FusedAdam}[args.optimizer]
    results, ratios = [], {}
    for which in args.sets.split(","):
        variants, opts = {}, {}
        for label, shard in (("dense", False), ("sharded", True)):
            net, fwd_bwd = build(which)
            opt = hvd.DistributedOptimizer(make_inner(net.parameters(), lr=1e-3),
                                           named_parameters=net.named_parameters(),
                                           shard_optimizer_state=shard)
            opts[label] = opt

            def iteration(opt=opt, fwd_bwd=fwd_bwd):
                opt.zero_grad()
                fwd_bwd()
                opt.step()
            variants[f"{which}_{label}"] = lambda it=iteration: timed(it, hvd.barrier)
        times = interleave(variants, args.reps, args.warmup)
        for name, samples in times.items():
            worst = [float(t) for t in hvd.allreduce(torch.tensor(samples, dtype=torch.float64),
                                                     op=hvd.Max,
                                                     name=f"times.{name}")]
            results.append(summarize(name, {"set": which, "optimizer": args.optimizer}, worst))
        dense = state_bytes(opts["dense"])
        shard = int(hvd.allreduce(torch.tensor(state_bytes(opts["sharded"])), op=hvd.Max,
                                  name=f"bytes.{which}"))
        ratios[f"sharded_state_bytes_fraction_{which}"] = shard / dense
        med = {r["name"]: r["median_s"] for r in results}
        ratios[f"sharded_vs_dense_step_{which}"] = med[f"{which}_dense"] / med[f"{which}_sharded"]
        results[-1]["params"].update(state_bytes=shard)
        results[-2]["params"].update(state_bytes=dense)
    if hvd.rank() == 0:
        machine = machine_info(ranks=n)
        report("sharded_bench", machine, results, ratios, args.json)
        print(f"# target: sharded_state_bytes_fraction <= 1/N + 0.05 = {1 / n + 0.05:.3f}")


if __name__ == "__main__":
    main()
