"""Gloo transport against MPI: the grouped allreduce of the ResNet-50-shaped gradient set.

Run under an MPI launcher (the MPI world is timed; a Gloo world of the same ranks is formed
in the same processes, over a store on rank 0)::

    aiakrun -np 2 python benchmarks/gloo_bench.py --json benchmarks/results/gloo_vs_mpi_2ranks_<date>.json

Each repetition runs one round per transport, alternating MPI, Gloo, MPI, Gloo ...: a round
starts the runtime on that transport (``hvd.init()``; Gloo through
``set_world_source``), runs ``--warmup`` untimed grouped allreduces (negotiation, response
cache, fusion buffer), times ``--calls`` more and keeps their median, then shuts down.

Ratio (above 1 means Gloo is faster):

  gloo_vs_mpi_grouped   time of hvd.grouped_allreduce of the 161 fp32 tensors (25.6M
                        elements) over MPI, divided by the same over Gloo (the same engine
                        on both sides: the transports alone).  Target >= 0.8.
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aiak_training.torch as hvd  # noqa: E402
from aiak_training.runtime.transport import (WorldInfo, set_world_source,  # noqa: E402
                                             start_rendezvous_server)
from bench_common import machine_info, report, resnet50_shapes, summarize  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=7, help="rounds per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per round")
    p.add_argument("--calls", type=int, default=3, help="timed calls per round")
    return p.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    store = None
    if rank == 0:
        store, port = start_rendezvous_server("127.0.0.1", 0)
    port = comm.bcast(port if rank == 0 else None, root=0)
    shapes = resnet50_shapes()
    total = sum(math.prod(s) for s in shapes)
    grads = [torch.randn(s) for s in shapes]
    rounds = [0]

    def one_round(gloo: bool) -> float:
        if gloo:
            info = WorldInfo(rank, size, rank, size, 0, 1, "localhost", "127.0.0.1", port,
                             prefix=f"bench{rounds[0]}")
            set_world_source(lambda: info)
        rounds[0] += 1
        hvd.init()
        assert hvd.gloo_enabled() == gloo
        for _ in range(args.warmup):
            hvd.grouped_allreduce(grads, name="rn50")
        samples = []
        for _ in range(args.calls):
            comm.Barrier()
            start = time.perf_counter()
            hvd.grouped_allreduce(grads, name="rn50")
            samples.append(time.perf_counter() - start)
        hvd.shutdown()
        set_world_source(None)
        return statistics.median(samples)

    variants = {"mpi_grouped": False, "gloo_grouped": True}
    times = {k: [] for k in variants}
    for _ in range(args.reps):
        for name, gloo in variants.items():
            times[name].append(one_round(gloo))
    params = {k: {"bytes": total * 4, "tensors": len(shapes), "transport": "gloo" if g else "mpi",
                  "calls_per_round": args.calls}
              for k, g in variants.items()}
    results = [summarize(k, params[k], v) for k, v in times.items()]
    med = {r["name"]: r["median_s"] for r in results}
    ratios = {"gloo_vs_mpi_grouped": med["mpi_grouped"] / med["gloo_grouped"]}
    if rank == 0:
        report("gloo_bench", machine_info(size), results, ratios, args.json)
    comm.Barrier()
    del store


if __name__ == "__main__":
    main()
