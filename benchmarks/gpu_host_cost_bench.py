"""Host time per tensor of a grouped CUDA allreduce, measured without a GPU (issue 29).

Issue 29 asks for the per-tensor loops of the CUDA path (submit, execute, complete) to be in
C++, as the host path's are.  This measures what those loops cost, without a GPU.  The engine
and the GPU executor run grouped allreduces of ``n`` one-element tensors on the host-memory
stand-ins for libcudart and NCCL of benchmarks/jobs/gpu_fakes.py (those of
tests/parallel/test_gpu_executor.py), submitted and waited on as the torch frontend does
(``gpu_fakes.submit_allreduce``: one list per field to ``Engine.submit_allreduces``, one
``wait_all``).  The batched-copy kernel's stand-in is one
C++ call (``native.copy_batch``), like the real launch.  So what is timed is this library's
host work plus the stand-ins' (a CUDA call is a Python method call, NCCL's allreduce one MPI
call on host memory), never CUDA's.

For comparison, the host path: ``hvd.grouped_allreduce_`` of ``n`` CPU tensors.  The two
paths do not do the same work: the GPU path submits to the engine directly, skipping the
frontend's per-tensor checks, result allocation and handles that ``hvd.grouped_allreduce_``
pays.  Compare each path with itself before and after a change, not the two with each other.

Figures (slopes of the median time over n = 8 ... 161, fitted by least squares):

  gpu_path_host_us_per_tensor     one grouped allreduce, submit to last wait, per tensor
  gpu_executor_us_per_tensor      the GPU executor's share (its allreduce of the fused
                                  response, on the engine thread)
  host_path_us_per_tensor         the same grouped allreduce of CPU tensors, per tensor

    python benchmarks/gpu_host_cost_bench.py --json PATH     (one process, no mpiexec)
"""
import argparse
import itertools
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "jobs")]
from bench_common import machine_info, report, summarize  # noqa: E402

COUNTS = (8, 32, 64, 161)  # 161: the ResNet-50 set's tensor count


def slope(xs, ys) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=200, help="timed calls per count")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    import aiak_training.torch as hvd
    from aiak_training.common import native
    from aiak_training.runtime.execute import gpu_executor
    import gpu_fakes  # the stand-ins and the frontend-like submit
    hvd.init()
    # Never taken back: the engine runs on these until the process ends.
    gpu_fakes.install(gpu_fakes.FakeRuntime(), gpu_fakes.FakeLibrary(), True,
                      lambda dsts, srcs, sizes, stream: native.copy_batch(dsts, srcs, sizes))
    names = itertools.count()

    def gpu_allreduce(tensors):
        gpu_fakes.submit_allreduce(tensors, tensors,
                                   [f"gpu_exec.{next(names)}" for _ in tensors], hvd.Sum)

    executor_s = []
    allreduce = gpu_executor.GpuExecutor.allreduce

    def timed_allreduce(self, state, group):
        start = time.perf_counter()
        event = allreduce(self, state, group)
        executor_s.append(time.perf_counter() - start)
        return event
    gpu_executor.GpuExecutor.allreduce = timed_allreduce

    results, medians = [], {"gpu": [], "executor": [], "host": []}
    for n in COUNTS:
        gpu = [torch.zeros(1) for _ in range(n)]
        host = [torch.zeros(1) for _ in range(n)]
        variants = {"gpu": lambda: gpu_allreduce(gpu),
                    "host": lambda: hvd.grouped_allreduce_(host, op=hvd.Sum)}
        for kind, fn in variants.items():
            for _ in range(20):
                fn()
            executor_s.clear()
            samples = []
            for _ in range(args.reps):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            results.append(summarize(f"{kind}_{n}_tensors", {"tensors": n}, samples))
            medians[kind].append(statistics.median(samples))
            if kind == "gpu":
                results.append(summarize(f"executor_{n}_tensors", {"tensors": n}, executor_s))
                medians["executor"].append(statistics.median(executor_s))
    per_tensor = {k: slope(COUNTS, v) * 1e6 for k, v in medians.items()}
    ratios = {"gpu_path_host_us_per_tensor": per_tensor["gpu"],
              "gpu_executor_us_per_tensor": per_tensor["executor"],
              "host_path_us_per_tensor": per_tensor["host"]}
    report("gpu_host_cost_bench", machine_info(), results, ratios, args.json)
    print("# the figures above are costs per tensor in microseconds (slopes), not ratios")


if __name__ == "__main__":
    main()
