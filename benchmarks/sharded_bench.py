"""Sharded optimizer state (shard_optimizer_state=True, issue 32): state bytes and step time.

Two parameter sets, each trained with Adam (or --optimizer) by a dense DistributedOptimizer
and by a sharded one, in the same launch:

  mlp       the e2e MLP of benchmarks/ (3072-1024-1024-1024-10, 5.26M parameters), forward and
            backward on a random batch of 32;
  resnet50  the ResNet-50 parameter set (161 tensors, 25.6M elements), loss = sum(w * c) for
            a fixed random c, so backward is cheap and the step dominates.

A third set, ``collectives``, times the engine's collectives on 16 MiB of float32 (the
default bucket size): allreduce of it, reducescatter of it, and allgather of 16 MiB / N from
each rank, plus, under MPI, mpi4py's Allgather and Allgatherv of the same pieces (MPICH runs
the v-variant with a slower algorithm; the engine now calls Allgather for equal pieces).

Run with mpiexec -n N (N = 2, 4), or aiakrun --gloo -np N; on the emulated 2 nodes x 2 ranks
cluster at 1 Gbit/s (root), as the sharded_vs_dense_step target asks::

    python -m aiak_training.testing.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        sh -c 'mpiexec -n 4 python benchmarks/sharded_bench.py --sets mlp --layout 2x2 \\
               --json benchmarks/results/sharded_2x2_1gbit.json'

Each timed sample is the slowest rank's iteration
(zero_grad, forward, backward, step; barrier before and after), dense and sharded alternating
after warm-up, each round starting one variant later than the one before.  ``--order`` sets
the order the variants are built in (and the first round's): on these machines an
optimizer's speed depended on its position among those built in one process by up to 15%,
so compare runs over several orders.  The sharded optimizer runs in both gradient modes
(AIAK_SHARD_GRADIENTS):
``sharded`` with the default, bounded gradients, ``sharded_flat`` with kept ones (each p.grad
a view of its bucket's buffer, reduce-scattered in place).  The variant and its figures keep
the mode's older name, ``flat``, under which the recorded results were taken.

Ratios:

  sharded_state_bytes_fraction_<set>   the largest optimizer-state byte count a rank holds
                                       with sharding / the dense optimizer's (the same on every
                                       rank).  Target <= 1/N + 0.05.
  sharded_vs_dense_step_<set>          median dense iteration time / median sharded iteration
                                       time (above 1: sharded faster), default (bounded)
                                       gradients;
  sharded_flat_vs_dense_step_<set>     the same with AIAK_SHARD_GRADIENTS=kept.
  allgather_vs_allreduce_16MB,         median allreduce time / median allgather (reducescatter)
  reducescatter_vs_allreduce_16MB      time of the same bytes (a ring moves half the bytes
                                       of an allreduce in each, so ~2 is the ideal).
  mpi_allgather_vs_allgatherv_16MB     median Allgatherv / median Allgather time (mpi4py).
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (interleave, link_gbit, machine_info, report,  # noqa: E402
                          resnet50_shapes, summarize, timed)

BUCKET_ELEMS = 4 << 20  # 16 MiB of float32: AIAK_SHARD_BUCKET_BYTES' default


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=7, help="timed iterations per variant (>= 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sets", default="mlp,resnet50")
    p.add_argument("--optimizer", choices=("adam", "fused_adam"), default="adam")
    p.add_argument("--order", default="dense,sharded,sharded_flat",
                   help="the order the variants are built and run in (each round starts one "
                        "later in it: rounds rotate)")
    p.add_argument("--layout", help="nodes x ranks to record, e.g. 2x2 (default 1xN)")
    p.add_argument("--link-gbit", type=float, help="link rate to record (default: the "
                   "emulated cluster's, when it says)")
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


def collectives(hvd, reps, warmup):
    """(results, ratios) of the ``collectives`` set (module docstring)."""
    n = hvd.size()
    full, piece = torch.ones(BUCKET_ELEMS), torch.ones(BUCKET_ELEMS // n)
    variants = {
        "allreduce_16MB": lambda: hvd.allreduce(full, name="c.ar"),
        "reducescatter_16MB": lambda: hvd.reducescatter(full, name="c.rs"),
        "allgather_16MB": lambda: hvd.allgather(piece, name="c.ag"),
    }
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_size() == n:  # an MPI job (under aiakrun --gloo each rank is alone)
        out = np.empty(BUCKET_ELEMS, dtype=np.float32)
        mine = piece.numpy()
        counts = [BUCKET_ELEMS // n] * n
        displs = [r * counts[0] for r in range(n)]
        variants["mpi_Allgather_16MB"] = lambda: comm.Allgather(mine, out)
        variants["mpi_Allgatherv_16MB"] = \
            lambda: comm.Allgatherv(mine, [out, (counts, displs), MPI.FLOAT])
    times = interleave({k: (lambda fn=fn: timed(fn, hvd.barrier)) for k, fn in variants.items()},
                       reps, warmup)
    results = []
    for name, samples in times.items():
        worst = [float(t) for t in hvd.allreduce(torch.tensor(samples, dtype=torch.float64),
                                                 op=hvd.Max, name=f"times.{name}")]
        results.append(summarize(name, {"set": "collectives", "elements": BUCKET_ELEMS}, worst))
    med = {r["name"]: r["median_s"] for r in results}
    ratios = {"allgather_vs_allreduce_16MB": med["allreduce_16MB"] / med["allgather_16MB"],
              "reducescatter_vs_allreduce_16MB":
                  med["allreduce_16MB"] / med["reducescatter_16MB"]}
    if "mpi_Allgather_16MB" in med:
        ratios["mpi_allgather_vs_allgatherv_16MB"] = \
            med["mpi_Allgatherv_16MB"] / med["mpi_Allgather_16MB"]
    return results, ratios


def main(argv=None):
    args = parse_args(argv)
    import aiak_training.torch as hvd
    from aiak_training.fused_optim import FusedAdam
    from aiak_training.torch.optim.sharded import GRADIENTS_ENV_VAR
    hvd.init()
    n = hvd.size()
    make_inner = {"adam": torch.optim.Adam, "fused_adam": FusedAdam}[args.optimizer]
    results, ratios = [], {}
    for which in args.sets.split(","):
        if which == "collectives":
            more, more_ratios = collectives(hvd, args.reps, args.warmup)
            results += more
            ratios.update(more_ratios)
            continue
        variants, opts = {}, {}
        kinds = {"dense": (False, None), "sharded": (True, "bounded"),
                 "sharded_flat": (True, "kept")}
        for label in args.order.split(","):
            shard, grads = kinds[label]
            net, fwd_bwd = build(which)
            if grads is not None:  # read when the optimizer is built
                os.environ[GRADIENTS_ENV_VAR] = grads
            opt = hvd.DistributedOptimizer(make_inner(net.parameters(), lr=1e-3),
                                           named_parameters=net.named_parameters(),
                                           shard_optimizer_state=shard)
            os.environ.pop(GRADIENTS_ENV_VAR, None)
            opts[label] = opt

            def iteration(opt=opt, fwd_bwd=fwd_bwd):
                opt.zero_grad()
                fwd_bwd()
                opt.step()
            variants[f"{which}_{label}"] = lambda it=iteration: timed(it, hvd.barrier)
        times = interleave(variants, args.reps, args.warmup, rotate=True)
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
        ratios[f"sharded_flat_vs_dense_step_{which}"] = \
            med[f"{which}_dense"] / med[f"{which}_sharded_flat"]
        for r in results[-3:]:
            r["params"].update(state_bytes=shard if "sharded" in r["name"] else dense,
                               gradients=None if r["name"].endswith("_dense") else
                               "kept" if r["name"].endswith("_flat") else "bounded")
    if hvd.rank() == 0:
        machine = machine_info(ranks=n, layout=args.layout,
                               link_gbit=link_gbit(args.link_gbit))
        report("sharded_bench", machine, results, ratios, args.json)
        print(f"# target: sharded_state_bytes_fraction <= 1/N + 0.05 = {1 / n + 0.05:.3f}")


if __name__ == "__main__":
    main()
