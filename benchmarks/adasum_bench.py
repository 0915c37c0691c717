"""Adasum benchmark: hvd.allreduce_ with op=hvd.Adasum against op=hvd.Sum, same tensor, same run.

Run with an MPI launcher (Adasum needs a power-of-two number of ranks), e.g.::

    mpiexec -n 4 python benchmarks/adasum_bench.py --json benchmarks/results/adasum_4ranks_<date>.json

Ratios (above 1 means Adasum is as fast as or faster than Sum):

  adasum_vs_sum_allreduce   median time of hvd.allreduce_(t, op=hvd.Sum) divided by the median
                            time of hvd.allreduce_(t, op=hvd.Adasum), one float32 tensor of
                            --mib MiB (64 by default), timed alternately (Sum, Adasum, Sum, ...)
                            after warm-up.  Target >= 0.5: Adasum moves the same bytes as a
                            ring allreduce plus 3 float64 per tensor per level, and adds two
                            passes over the data per level (dot products, scaled add).
  adasum_vs_sum_rn50_grouped
                            the same for hvd.grouped_allreduce_ of the 161 float32 tensors of
                            ResNet-50 (25.6M elements; fused, per-tensor coefficients).  With
                            --no-grouped it is skipped.

Timing covers the collective only (both ranks meet at a barrier before and after); the
tensor is refilled from a saved copy before each repetition, outside the timed region, since
both ops work in place.  On a machine with fewer cores than ranks (4 ranks on 2 cores) the
ranks time-share the cores, which penalizes Adasum's extra arithmetic more than Sum: the
figure is then a lower bound on what dedicated cores give.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_common import interleave, machine_info, report, resnet50_shapes, summarize, timed  # noqa: E402

import aiak_training.torch as hvd  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=64.0, help="tensor size in MiB (float32)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions of each op")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-grouped", action="store_true", help="skip the ResNet-50 grouped case")
    p.add_argument("--json", help="write the figures here (rank 0)")
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    n = int(args.mib * 2 ** 20) // 4
    g = torch.Generator().manual_seed(hvd.rank())
    source = torch.randn(n, generator=g)
    work = source.clone()
    barrier = hvd.barrier

    def single(op, label):
        def run():
            work.copy_(source)
            return timed(lambda: hvd.allreduce_(work, op=op, name=label), barrier)
        return run

    variants = {"sum_64mib": single(hvd.Sum, "bench.sum"),
                "adasum_64mib": single(hvd.Adasum, "bench.adasum")}
    if not args.no_grouped:
        shapes = resnet50_shapes()
        sources = [torch.randn(s, generator=g) for s in shapes]
        works = [s.clone() for s in sources]

        def grouped(op, label):
            def run():
                for w, s in zip(works, sources):
                    w.copy_(s)
                return timed(lambda: hvd.grouped_allreduce_(works, op=op, name=label), barrier)
            return run
        variants["sum_rn50_grouped"] = grouped(hvd.Sum, "bench.gsum")
        variants["adasum_rn50_grouped"] = grouped(hvd.Adasum, "bench.gadasum")

    times = interleave(variants, args.reps, args.warmup)
    if hvd.rank() == 0:
        from aiak_training.allreduce import _adasum_cpu
        params = {"bytes": n * 4, "dtype": "float32", "kernel_isa": _adasum_cpu.isa()}
        results = [summarize(name, dict(params) if "64mib" in name else
                             {"tensors": 161, "dtype": "float32",
                              "kernel_isa": _adasum_cpu.isa()}, samples)
                   for name, samples in times.items()]
        med = {r["name"]: r["median_s"] for r in results}
        ratios = {"adasum_vs_sum_allreduce": med["sum_64mib"] / med["adasum_64mib"]}
        if not args.no_grouped:
            ratios["adasum_vs_sum_rn50_grouped"] = (med["sum_rn50_grouped"]
                                                    / med["adasum_rn50_grouped"])
        machine = machine_info(ranks=hvd.size())
        if (os.cpu_count() or 1) < hvd.size():
            machine["note"] = (f"oversubscribed: {hvd.size()} ranks on {os.cpu_count()} cores")
        report("adasum_vs_sum", machine, results, ratios, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
