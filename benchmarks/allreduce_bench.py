"""Allreduce benchmark: aiak-training's engine against raw MPI and torch.distributed Gloo.

Run with an MPI launcher, e.g.::

    aiakrun -np 2 python benchmarks/allreduce_bench.py --json out.json
    mpiexec -n 2 python benchmarks/allreduce_bench.py --json out.json

Ratios (above 1 means aiak-training is better):

  fused_vs_raw_mpi          time of one raw mpi4py Allreduce of the same total bytes, divided
                            by the time of hvd.grouped_allreduce over a ResNet-50-shaped
                            gradient set (161 fp32 tensors, 25.6M elements). Target >= 0.85.
  fused_inplace_vs_raw_mpi  the same with hvd.grouped_allreduce_ (in place, as
                            DistributedOptimizer reduces gradients).
  fusion_small_speedup      200 tensors of 1,024 fp32 elements submitted asynchronously then
                            synchronized: time with fusion off (HOROVOD_FUSION_THRESHOLD=0)
                            divided by time with the default fused path. Target >= 5.
  vs_gloo_ddp_buckets       torch.distributed Gloo all_reduce over the same gradient set
                            packed in 25 MiB buckets (what DDP does, averaging included),
                            divided by hvd.grouped_allreduce_ time. Target >= 1.0.
"""
import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aiak_training.torch as hvd  # noqa: E402
from aiak_training.common import basics  # noqa: E402
from bench_common import (interleave, machine_info, report, resnet50_shapes,  # noqa: E402
                          summarize, timed)

BUCKET_BYTES = 25 * 1024 * 1024


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-gloo", action="store_true", help="skip the torch.distributed baseline")
    p.add_argument("--layout", help="layout string for the JSON header, e.g. 2x2")
    p.add_argument("--link-gbit", type=float, default=None)
    return p.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    barrier = comm.Barrier
    engine = basics._engine()

    shapes = resnet50_shapes()
    total = sum(math.prod(s) for s in shapes)
    grads = [torch.randn(s) for s in shapes]
    raw = np.random.rand(total).astype(np.float32)
    small = [torch.randn(1024) for _ in range(200)]
    default_threshold = engine.config.fusion_threshold

    def raw_mpi():
        return timed(lambda: comm.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM), barrier)

    def grouped():
        return timed(lambda: hvd.grouped_allreduce(grads, name="rn50"), barrier)

    def grouped_inplace():
        return timed(lambda: hvd.grouped_allreduce_(grads, name="rn50_"), barrier)

    def small_tensors(threshold):
        def run():
            # Same setting on every rank before anything is submitted (see barrier in timed).
            engine.config.fusion_threshold = threshold
            def body():
                hs = [hvd.allreduce_async(t, name=f"small.{i}") for i, t in enumerate(small)]
                for h in hs:
                    hvd.synchronize(h)
            elapsed = timed(body, barrier)
            engine.config.fusion_threshold = default_threshold
            return elapsed
        return run

    variants = {"raw_mpi_allreduce": raw_mpi, "hvd_grouped_allreduce": grouped,
                "hvd_grouped_allreduce_inplace": grouped_inplace,
                "small200_fused": small_tensors(default_threshold),
                "small200_unfused": small_tensors(0)}

    if not args.no_gloo:
        port = comm.bcast(_free_port() if rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
        # DDP packs gradients (in reverse order) into ~25 MiB buckets and averages them.
        buckets, current, cur_bytes = [], [], 0
        for g in reversed(grads):
            current.append(g)
            cur_bytes += g.numel() * 4
            if cur_bytes >= BUCKET_BYTES:
                buckets.append(torch.cat([t.reshape(-1) for t in current]))
                current, cur_bytes = [], 0
        if current:
            buckets.append(torch.cat([t.reshape(-1) for t in current]))

        def gloo():
            def body():
                works = [dist.all_reduce(b, async_op=True) for b in buckets]
                for w, b in zip(works, buckets):
                    w.wait()
                    b.div_(size)
            return timed(body, barrier)
        variants["gloo_ddp_buckets"] = gloo

    times = interleave(variants, args.reps, args.warmup)
    params = {
        "raw_mpi_allreduce": {"bytes": total * 4, "tensors": 1},
        "hvd_grouped_allreduce": {"bytes": total * 4, "tensors": len(shapes)},
        "hvd_grouped_allreduce_inplace": {"bytes": total * 4, "tensors": len(shapes)},
        "small200_fused": {"tensors": 200, "elements": 1024,
                           "fusion_threshold": default_threshold},
        "small200_unfused": {"tensors": 200, "elements": 1024, "fusion_threshold": 0},
        "gloo_ddp_buckets": {"bytes": total * 4, "bucket_bytes": BUCKET_BYTES},
    }
    # Rank 0 reports; every rank timed between the same barriers.
    results = [summarize(k, params[k], v) for k, v in times.items()]
    med = {r["name"]: r["median_s"] for r in results}
    ratios = {
        "fused_vs_raw_mpi": med["raw_mpi_allreduce"] / med["hvd_grouped_allreduce"],
        "fused_inplace_vs_raw_mpi": med["raw_mpi_allreduce"] / med["hvd_grouped_allreduce_inplace"],
        "fusion_small_speedup": med["small200_unfused"] / med["small200_fused"],
    }
    if "gloo_ddp_buckets" in med:
        ratios["vs_gloo_ddp_buckets"] = med["gloo_ddp_buckets"] / med["hvd_grouped_allreduce_inplace"]
    if rank == 0:
        report("allreduce_bench", machine_info(size, args.layout, args.link_gbit), results,
               ratios, args.json)
    if not args.no_gloo:
        dist.destroy_process_group()
    hvd.shutdown()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
