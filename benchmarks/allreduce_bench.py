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
  fusion_small_ceiling_raw_mpi
                            what fusion can gain on this machine with no engine at all: 200
                            raw mpi4py Allreduce calls of those tensors (out of place),
                            divided by packing them with the C++ batched copy, one in-place
                            Allreduce, and unpacking.  No per-tensor cost besides MPI's own.
  fusion_small_bound_api    the same two raw times, each plus the least a per-tensor Python
                            API costs (api_floor_small200: 200 calls that allocate a result
                            with torch.empty_like and file a handle, then 200 that take it
                            back): the best fusion_small_speedup an engine that costs
                            nothing per tensor could show behind hvd.allreduce_async.
  vs_gloo_ddp_buckets       torch.distributed Gloo all_reduce over the same gradient set
                            packed in 25 MiB buckets (what DDP does, averaging included),
                            divided by hvd.grouped_allreduce_ time. Target >= 1.0.

These figures of this mode are costs, where lower is better:

  per_tensor_overhead_us    what the engine spends per small tensor beyond raw MPI on the
                            fused path, in microseconds (not a ratio): (small200_fused -
                            raw_mpi_small200_packed - api_floor_small200) / 200 * 1e6, from
                            the medians of the same run. Target <= 3.
  gil_contention_slowdown   hvd.grouped_allreduce_async_ of the ResNet-50-shaped set, then
                            completion, while the main thread runs pure-Python bytecode that
                            holds the GIL (chunks of about 30 us, hvd.poll between chunks;
                            rn50_grouped_busy_main), divided by the same with the main
                            thread idle in hvd.synchronize (rn50_grouped_idle_main). Both
                            ranks do the busy work. Target <= 1.1. On a machine with fewer
                            cores than busy threads (2 ranks x 2 threads on 2 cores) CPU
                            time-sharing dominates this figure whatever the engine; the two
                            figures below separate it from the GIL's share.
  cpu_contention_slowdown   the same grouped allreduce with the main thread idle while a
                            separate pure-Python process per rank spins on the CPU
                            (rn50_grouped_busy_process), divided by rn50_grouped_idle_main:
                            the slowdown that sharing the cores alone causes, with no GIL
                            shared.  A machine figure, not a target.
  gil_share_of_slowdown     rn50_grouped_busy_main / rn50_grouped_busy_process: what the
                            busy thread costs beyond the same CPU load in another process,
                            i.e. the GIL's part.  1.0 means none; the GIL-free engine's aim.

Algorithm mode (--algos): times the allreduce algorithms of aiak_training.allreduce directly
(exactly what the engine calls on a fused buffer), one fp32 buffer per size, interleaved
A B C A B C after warm-up, on an emulated cluster, e.g.::

    python -m aiak_training.testing.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- \
        sh -c 'mpiexec -n 4 python benchmarks/allreduce_bench.py \
               --algos flat,hier_staged,hier_pipelined \
               --json benchmarks/results/hier_2x2_1gbit_<date>.json'

(benchmarks/plots.py draws the results pages' plot from that JSON; --plot PNG draws one
directly.)

Ratios of this mode (above 1 means hier_pipelined is faster); SUFFIX is --ratio-suffix, by default
"" on a 1 Gbit/s cluster and "_<N>gbit" on others (from AIAK_CLUSTER_NOMINAL_GBIT):

  hier_vs_flat_64MB<SUFFIX>           flat time / hier_pipelined time for a 64 MiB buffer.
                                      Target >= 1.35 at 1 Gbit/s on 2x2 (bytes bound 1.5);
                                      no regression beyond noise at 5 Gbit/s.
  hier_vs_horovod_hier_64MB<SUFFIX>   hier_staged time / hier_pipelined time, 64 MiB.
                                      Target >= 1.10 at 1 Gbit/s on 2x2.

CUDA mode (--device cuda; needs a GPU, one rank per GPU), e.g. ``python
benchmarks/allreduce_bench.py --device cuda --json gpu.json`` at 1 rank.  Ratio:

  gpu_pack_bandwidth_fraction   bandwidth of the engine's fusion-buffer pack plus unpack
                                (aiak_training.runtime.execute.gpu_buffers.pack / unpack over
                                the ResNet-50-shaped set of CUDA tensors, as the engine runs them:
                                the batched-copy kernel where built; 2x the bytes) divided by
                                that of one device-to-device copy of the whole set.  Target
                                >= 0.7.

The former gpu_fused_vs_raw_nccl_1rank is retired: it divided one in-place 1-rank
ncclAllReduce (which does no device work at one rank) by a grouped allreduce of 161 tensors,
so even a path with no overhead could not approach its target.  The GPU path is now measured
against what a GPU user would otherwise run: benchmarks/gpu_bench.py.

Each result row is one (algorithm, size): params hold bytes, inner (calls per timed sample;
small sizes repeat the call so a sample is long enough to time) and busbw_gbs, the median's
bus bandwidth in GB/s: bytes / time * 2 (p - 1) / p, as nccl-tests reports it.
"""
import argparse
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aiak_training.torch as hvd  # noqa: E402
from aiak_training.common import native  # noqa: E402
from bench_common import (interleave, link_gbit, machine_info, report, resnet50_shapes,  # noqa: E402
                          summarize, timed)

BUCKET_BYTES = 25 * 1024 * 1024
BUSY_CHUNK_TARGET_S = 30e-6  # pure-Python work between two hvd.poll calls (busy variant)


def _busy_chunk(iters: int, scratch: dict) -> int:
    """Pure-Python bytecode that holds the GIL throughout: integer arithmetic and dict
    stores, no sleeps and no calls into C that release the GIL."""
    acc = 0
    for i in range(iters):
        acc = (acc * 31 + i) & 0xFFFFF
        scratch[i & 63] = acc
    return acc


def _calibrate_busy_chunk(target_s: float = BUSY_CHUNK_TARGET_S):
    """Iterations of :func:`_busy_chunk` that take about ``target_s`` on this rank, and the
    measured seconds of one such chunk (median of a few trials)."""
    scratch: dict = {}
    _busy_chunk(100_000, scratch)  # warm up
    trials = []
    for _ in range(5):
        start = time.perf_counter()
        _busy_chunk(200_000, scratch)
        trials.append((time.perf_counter() - start) / 200_000)
    per_iter = float(np.median(trials))
    iters = max(1, int(round(target_s / per_iter)))
    chunk = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(100):
            _busy_chunk(iters, scratch)
        chunk.append((time.perf_counter() - start) / 100)
    return iters, float(np.median(chunk))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-gloo", action="store_true", help="skip the torch.distributed baseline")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the GPU ratios (see above)")
    p.add_argument("--layout", help="layout string for the JSON header, e.g. 2x2")
    p.add_argument("--link-gbit", type=float, default=None)
    p.add_argument("--algos", help="algorithm mode: comma-separated algorithms to compare, "
                   "e.g. flat,hier_staged,hier_pipelined (see above)")
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M,256M",
                   help="algorithm mode: buffer sizes in bytes (K/M/G suffixes allowed)")
    p.add_argument("--big-reps", type=int, default=5,
                   help="algorithm mode: timed reps for sizes >= 32 MiB (--reps for smaller)")
    p.add_argument("--plot", metavar="PNG", help="algorithm mode: plot bus bandwidth vs size")
    p.add_argument("--ratio-suffix", default=None,
                   help="algorithm mode: suffix of the ratio keys (default: from the link rate)")
    return p.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(1)
    if args.algos:
        run_algorithms(args)
        return
    if args.device == "cuda":
        run_cuda(args)
        return
    from aiak_training.runtime import current  # here: the Gloo worker must not need it
    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    barrier = comm.Barrier
    engine = current.engine()
    engine_kind = getattr(engine, "kind", "python")

    shapes = resnet50_shapes()
    total = sum(math.prod(s) for s in shapes)
    grads = [torch.randn(s) for s in shapes]
    raw = np.random.rand(total).astype(np.float32)
    small = [torch.randn(1024) for _ in range(200)]
    small_out = [torch.empty(1024) for _ in range(200)]
    packed = np.empty(200 * 1024, dtype=np.float32)
    slots = [packed.ctypes.data + i * 4096 for i in range(200)]
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

    def raw_small_unfused():
        def body():
            for t, o in zip(small, small_out):
                comm.Allreduce(t.numpy(), o.numpy(), op=MPI.SUM)
        return timed(body, barrier)

    def raw_small_packed():
        def body():
            native.copy_batch(slots, [t.data_ptr() for t in small], [4096] * 200)
            comm.Allreduce(MPI.IN_PLACE, packed, op=MPI.SUM)
            native.copy_batch([o.data_ptr() for o in small_out], slots, [4096] * 200)
        return timed(body, barrier)

    def api_floor():
        table, ids = {}, iter(range(1 << 62))

        def submit(t):
            handle = next(ids)
            table[handle] = torch.empty_like(t)
            return handle

        def body():
            hs = [submit(t) for t in small]
            for h in hs:
                table.pop(h)
        return timed(body, barrier)

    # GIL contention: the same in-place grouped allreduce, with the main thread idle in
    # synchronize, or busy with pure-Python work (polling between chunks) until it is done.
    busy_iters, busy_chunk_s = _calibrate_busy_chunk()
    busy_scratch: dict = {}

    def rn50_idle_main():
        def body():
            h = hvd.grouped_allreduce_async_(grads, name="gil")
            hvd.synchronize(h)
        return timed(body, barrier)

    def rn50_busy_main():
        def body():
            h = hvd.grouped_allreduce_async_(grads, name="gil")
            while True:
                _busy_chunk(busy_iters, busy_scratch)
                if hvd.poll(h):
                    break
            hvd.synchronize(h)  # already done: only hands back the result
        return timed(body, barrier)

    spin_argv = [sys.executable, "-c", "while True:\n    pass"]

    def rn50_busy_process():
        # The same CPU load as the busy main thread, in another process: no GIL shared.
        spinner = subprocess.Popen(spin_argv)
        try:
            time.sleep(0.05)  # let it start spinning before the timed region
            def body():
                h = hvd.grouped_allreduce_async_(grads, name="gil")
                hvd.synchronize(h)
            return timed(body, barrier)
        finally:
            spinner.kill()
            spinner.wait()

    variants = {"raw_mpi_allreduce": raw_mpi, "hvd_grouped_allreduce": grouped,
                "hvd_grouped_allreduce_inplace": grouped_inplace,
                "small200_fused": small_tensors(default_threshold),
                "small200_unfused": small_tensors(0),
                "raw_mpi_small200_unfused": raw_small_unfused,
                "raw_mpi_small200_packed": raw_small_packed,
                "api_floor_small200": api_floor,
                "rn50_grouped_idle_main": rn50_idle_main,
                "rn50_grouped_busy_main": rn50_busy_main,
                "rn50_grouped_busy_process": rn50_busy_process}

    if not args.no_gloo:
        port = comm.bcast(_free_port() if rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
        # DDP packs gradients (in reverse order) into ~25 MiB buckets and averages them.
        buckets, pending, cur_bytes = [], [], 0
        for g in reversed(grads):
            pending.append(g)
            cur_bytes += g.numel() * 4
            if cur_bytes >= BUCKET_BYTES:
                buckets.append(torch.cat([t.reshape(-1) for t in pending]))
                pending, cur_bytes = [], 0
        if pending:
            buckets.append(torch.cat([t.reshape(-1) for t in pending]))

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
        "raw_mpi_small200_unfused": {"tensors": 200, "elements": 1024},
        "raw_mpi_small200_packed": {"tensors": 200, "elements": 1024},
        "api_floor_small200": {"tensors": 200, "elements": 1024},
        "rn50_grouped_idle_main": {"bytes": total * 4, "tensors": len(shapes),
                                   "main_thread": "idle in synchronize"},
        "rn50_grouped_busy_main": {"bytes": total * 4, "tensors": len(shapes),
                                   "main_thread": "pure-Python busy work, poll between chunks",
                                   "chunk_us": round(busy_chunk_s * 1e6, 2),
                                   "chunk_iters": busy_iters},
        "rn50_grouped_busy_process": {"bytes": total * 4, "tensors": len(shapes),
                                      "main_thread": "idle in synchronize",
                                      "other_process": "one pure-Python spinner per rank"},
        "gloo_ddp_buckets": {"bytes": total * 4, "bucket_bytes": BUCKET_BYTES},
    }
    # Rank 0 reports; every rank timed between the same barriers.
    results = [summarize(k, params[k], v) for k, v in times.items()]
    med = {r["name"]: r["median_s"] for r in results}
    ratios = {
        "fused_vs_raw_mpi": med["raw_mpi_allreduce"] / med["hvd_grouped_allreduce"],
        "fused_inplace_vs_raw_mpi": med["raw_mpi_allreduce"] / med["hvd_grouped_allreduce_inplace"],
        "fusion_small_speedup": med["small200_unfused"] / med["small200_fused"],
        "fusion_small_ceiling_raw_mpi":
            med["raw_mpi_small200_unfused"] / med["raw_mpi_small200_packed"],
        "fusion_small_bound_api":
            (med["raw_mpi_small200_unfused"] + med["api_floor_small200"])
            / (med["raw_mpi_small200_packed"] + med["api_floor_small200"]),
        # Costs, lower is better (see --help).
        "per_tensor_overhead_us":
            (med["small200_fused"] - med["raw_mpi_small200_packed"] - med["api_floor_small200"])
            / 200 * 1e6,
        "gil_contention_slowdown": med["rn50_grouped_busy_main"] / med["rn50_grouped_idle_main"],
        "cpu_contention_slowdown":
            med["rn50_grouped_busy_process"] / med["rn50_grouped_idle_main"],
        "gil_share_of_slowdown":
            med["rn50_grouped_busy_main"] / med["rn50_grouped_busy_process"],
    }
    if "gloo_ddp_buckets" in med:
        ratios["vs_gloo_ddp_buckets"] = med["gloo_ddp_buckets"] / med["hvd_grouped_allreduce_inplace"]
    if rank == 0:
        machine = machine_info(size, args.layout, args.link_gbit)
        machine["engine"] = engine_kind
        report("allreduce_bench", machine, results, ratios, args.json)
        print("  (per_tensor_overhead_us is a cost in us, target <= 3; gil_contention_slowdown "
              "target <= 1.1; cpu_contention_slowdown and gil_share_of_slowdown explain it: "
              "for these four, lower is better)")
    if not args.no_gloo:
        dist.destroy_process_group()
    hvd.shutdown()


# ---- CUDA mode (--device cuda) ---------------------------------------------------------------
def run_cuda(args) -> None:
    from aiak_training.common.gpu import kernels, nccl
    from aiak_training.runtime import current
    from aiak_training.common.gpu.cudart import runtime
    from aiak_training.runtime.execute.gpu_buffers import FUSION_ALIGN, pack, unpack

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device (torch.cuda.is_available() is "
                         "False)")
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    comm = MPI.COMM_WORLD
    shapes = resnet50_shapes()
    total = sum(math.prod(s) for s in shapes)
    grads = [torch.randn(s, device=dev) for s in shapes]
    flat = torch.randn(total, device=dev)
    copy_dst = torch.empty_like(flat)
    fusion = torch.empty(total + FUSION_ALIGN * len(shapes), device=dev)  # room for padding
    outs = [torch.empty_like(g) for g in grads]
    sizes = [g.numel() * 4 for g in grads]
    rt = runtime()
    lib = nccl.library()

    def barrier():
        torch.cuda.synchronize()
        comm.Barrier()

    def on_device(fn):
        def run():
            def body():
                fn()
                torch.cuda.synchronize()
            return timed(body, barrier)
        return run

    stream = lambda: int(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    variants = {
        "hvd_grouped_allreduce_cuda": on_device(lambda: hvd.grouped_allreduce(grads,
                                                                              name="rn50cuda")),
        "d2d_copy": on_device(lambda: copy_dst.copy_(flat)),
    }
    # What the engine does: the batched-copy kernel where it was built, else one
    # cudaMemcpyAsync per tensor (timed separately, for comparison).
    batched = kernels.library() is not None

    def pack_unpack(use_kernel):
        return on_device(lambda: unpack(
            rt, [o.data_ptr() for o in outs],
            pack(rt, fusion.data_ptr(), [g.data_ptr() for g in grads], sizes, stream(),
                 use_kernel, FUSION_ALIGN if use_kernel else 1), sizes, stream(), use_kernel))
    variants["engine_pack_unpack"] = pack_unpack(batched)
    if batched:
        variants["memcpy_pack_unpack"] = pack_unpack(False)
    times = interleave(variants, args.reps, args.warmup)
    params = {"hvd_grouped_allreduce_cuda": {"bytes": total * 4, "tensors": len(shapes)},
              "d2d_copy": {"bytes": total * 4},
              "engine_pack_unpack": {"bytes": 2 * total * 4, "tensors": len(shapes),
                                     "batched_kernel": batched},
              "memcpy_pack_unpack": {"bytes": 2 * total * 4, "tensors": len(shapes)}}
    results = [summarize(k, params[k], v) for k, v in times.items()]
    med = {r["name"]: r["median_s"] for r in results}
    ratios = {"gpu_pack_bandwidth_fraction": 2 * med["d2d_copy"] / med["engine_pack_unpack"]}
    if comm.Get_rank() == 0:
        gpu = f"{torch.cuda.get_device_name(dev)} (NCCL {nccl.nccl_version_text(lib)})"
        machine = machine_info(comm.Get_size(), args.layout, None, gpu=gpu)
        machine["engine"] = getattr(current.engine(), "kind", "python")
        report("allreduce_bench_cuda", machine, results, ratios, args.json)
    hvd.shutdown()


# ---- algorithm mode (--algos) ----------------------------------------------------------------
def _parse_size(text: str) -> int:
    from aiak_training.common.env import parse_bytes
    value = parse_bytes(text)
    if value is None or value <= 0:
        raise SystemExit(f"--sizes: cannot read {text!r}")
    return value


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def run_algorithms(args) -> None:
    """Time each algorithm of --algos at each of --sizes; rank 0 reports (see --help)."""
    from aiak_training.allreduce import close_algorithm, create_algorithm
    from aiak_training.common.dtypes import DataType, ReduceOp
    from aiak_training.common.topology import build_topology

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    topo = build_topology(comm)
    from aiak_training.common.config import ALLREDUCE_ALGO_ALIASES
    # Resolve the earlier spellings first: results, ratios and the plot are keyed by the
    # canonical names, so "aiak-hier" must become "hier_pipelined" before anything is timed.
    names = []
    for a in args.algos.split(","):
        n = ALLREDUCE_ALGO_ALIASES.get(a.strip(), a.strip())
        if n and n not in names:
            names.append(n)
    sizes = [_parse_size(x) for x in args.sizes.split(",") if x.strip()]
    algos = {n: create_algorithm(n, topo) for n in names}
    # Zeros stay zeros under repeated in-place sums (no overflow, no denormals); fill() touches
    # every page so no run pays first-touch faults.
    buf = np.empty(max(sizes) // 4 + 1, dtype=np.float32)
    buf.fill(0.0)
    addr = buf.ctypes.data
    results, med = [], {}
    for nbytes in sizes:
        count = nbytes // 4
        # Repeat small calls inside one sample so that it lasts about 20 ms or more.
        inner = max(1, min(200, (2 << 20) // nbytes))
        reps = args.reps if nbytes < (32 << 20) else args.big_reps
        warmup = args.warmup if nbytes < (32 << 20) else 1

        def variant(algo):
            def run():
                def body():
                    for _ in range(inner):
                        algo(topo, addr, count, DataType.FLOAT32, ReduceOp.SUM)
                return timed(body, comm.Barrier) / inner
            return run

        times = interleave({n: variant(a) for n, a in algos.items()}, reps, warmup)
        for n, samples in times.items():
            row = summarize(f"{n}@{_human(nbytes).replace(' ', '')}",
                            {"algo": n, "bytes": nbytes, "dtype": "float32", "inner": inner},
                            samples)
            t = row["median_s"]
            row["params"]["busbw_gbs"] = nbytes / t * 2 * (size - 1) / size / 1e9
            results.append(row)
            med[(n, nbytes)] = t
        if rank == 0:
            cells = "  ".join(f"{n} {med[(n, nbytes)] * 1e3:9.3f} ms" for n in names)
            print(f"# {_human(nbytes):>8}: {cells}", flush=True)
    for a in algos.values():
        close_algorithm(a)

    suffix = args.ratio_suffix
    nominal = os.environ.get("AIAK_CLUSTER_NOMINAL_GBIT")
    if suffix is None:
        suffix = "" if nominal in (None, "1") else f"_{nominal}gbit"
    ratios = {}
    big = 64 << 20
    if ("hier_pipelined", big) in med:
        if ("flat", big) in med:
            ratios[f"hier_vs_flat_64MB{suffix}"] = med[("flat", big)] / med[("hier_pipelined", big)]
        if ("hier_staged", big) in med:
            ratios[f"hier_vs_horovod_hier_64MB{suffix}"] = (med[("hier_staged", big)]
                                                            / med[("hier_pipelined", big)])
    layout = args.layout or (f"{topo.num_nodes}x{topo.node_sizes[0]}" if topo.is_homogeneous
                             else "+".join(str(n) for n in topo.node_sizes))
    link = link_gbit(args.link_gbit)
    if rank == 0:
        machine = machine_info(size, layout, link)
        if nominal:
            machine["link_nominal_gbit"] = float(nominal)
        report("allreduce_bench --algos", machine, results, ratios, args.json)
        if args.plot:
            _plot(args.plot, names, sizes, results, machine)
    topo.free()


def _plot(path: str, names, sizes, results, machine) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for n in names:
        rows = sorted((r for r in results if r["params"]["algo"] == n),
                      key=lambda r: r["params"]["bytes"])
        ax.plot([r["params"]["bytes"] for r in rows], [r["params"]["busbw_gbs"] for r in rows],
                marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes)
    ax.set_xticklabels([_human(x).replace(" ", "") for x in sizes], rotation=45)
    ax.set_xlabel("buffer size (fp32)")
    ax.set_ylabel("bus bandwidth, GB/s (bytes/t x 2(p-1)/p)")
    link = machine.get("link_gbit")
    title = f"allreduce, {machine['layout']} ranks"
    if link:
        title += f", {machine.get('link_nominal_gbit', link):g} Gbit/s link (measured {link:.3g})"
        # Not a ceiling: busbw assumes a flat ring, so a 2-level algorithm on N nodes of l
        # ranks can reach link * (p-1)/p / ((N-1)/N) (1.5x on 2x2).
        ax.axhline(link / 8, color="grey", ls=":", lw=1, label="measured link rate")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
