#!/usr/bin/env python
"""GPU benchmarks against what a GPU user would otherwise run, on one GPU.

Each benchmark times aiak-training and its baseline in one launch, interleaved (A B A B ...)
after warm-up, and reports medians (docs/benchmarks/index.md).  Needs a CUDA device.

  python3 benchmarks/gpu_bench.py --bench grouped --json PATH            # 1 rank
  python3 benchmarks/gpu_bench.py --bench step --json PATH               # 1 rank
  mpiexec -n 2 python3 benchmarks/gpu_bench.py --bench staged --json PATH  # 2 ranks, 1 GPU

Benchmarks and their ratio keys:

grouped (1 rank): the 161 ResNet-50 gradients (fp32, 102 MB) on the GPU.
  hvd_grouped_allreduce_   hvd.grouped_allreduce_(grads) (Average), to completion on the device
  torch_ddp_buckets        torch.distributed NCCL at world size 1 doing what DDP does per step:
                           gradients in reverse order in 25 MiB buckets; per bucket flatten
                           (torch.cat), divide by the world size, all_reduce, copy back
                           (torch._foreach_copy_)
  gpu_grouped_vs_torch_buckets_1rank = torch_ddp_buckets / hvd_grouped_allreduce_
                           (above 1: aiak-training is faster).  Target >= 0.9.

step (1 rank): one training step (forward, backward, SGD with momentum) of a pure-torch
  transformer encoder of about 200M parameters (16 layers, d_model 1024, 16 heads, FFN 4096,
  batch 8 x 512 tokens) under bf16 autocast, three copies of the same model:
  plain                    the step with no distributed code
  hvd_distributed_optimizer  hvd.DistributedOptimizer around the same optimizer
  torch_ddp                DistributedDataParallel at world size 1 (NCCL)
  gpu_step_overhead        = hvd / plain step time: a cost, lower is better.  Target <= 1.03.
  gpu_step_overhead_vs_ddp_ms = (hvd - plain) - (ddp - plain), in ms: a cost, lower is
                           better.  Target <= 1.

staged (2 ranks sharing one GPU; NCCL refuses that, so the library stages through host
  memory and MPI, as it chooses by itself): the ResNet-50 set, rank-dependent integer values.
  hvd_staged_grouped_allreduce  hvd.grouped_allreduce(grads, op=Sum), to completion
  floor_d2h_mpi_h2d        one flat buffer of the same bytes: copy to pinned host memory, MPI
                           Allreduce in place, copy back; nothing else
  gpu_staged_2ranks_vs_floor = hvd / floor: a cost, lower is better.  Target <= 1.3.
  Both results are checked exactly against the sum every rank can compute.

--smoke-cpu runs the same code on CPU tensors (torch.distributed over Gloo, a 1-layer model,
a few tensors) to check the script itself where there is no GPU; its figures mean nothing.

The 1-rank figures measure the real path.  The engine has no 1-rank short-cut for
collectives: negotiation, fusion, events and NCCL calls all run (the JSON names the GPU
transport the engine chose).  hvd.DistributedOptimizer, as Horovod's, registers no gradient
hooks at one rank, so the step benchmark registers them itself (``_register_hooks``): every
gradient then goes through allreduce as it would at several ranks.
"""
import argparse
import copy
import math
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import interleave, machine_info, report, resnet50_shapes, summarize  # noqa: E402

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", choices=("grouped", "step", "staged"), required=True)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (>= 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--inner", type=int, default=0,
                   help="calls (steps) per timed sample; 0: the benchmark's default")
    p.add_argument("--layers", type=int, default=16, help="step: encoder layers")
    p.add_argument("--batch", type=int, default=8, help="step: sequences per step")
    p.add_argument("--seq", type=int, default=512, help="step: tokens per sequence")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="check the script on CPU tensors, small sizes (figures mean nothing)")
    args = p.parse_args(argv)
    if args.reps < 5:
        p.error("--reps must be at least 5 (medians of at least 5 repetitions)")
    return args


def device_of(args) -> torch.device:
    if args.smoke_cpu:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def sync(device: torch.device) -> None:
    """Wait for the device (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "none (--smoke-cpu: figures mean nothing)"
    from aiak_training.common.gpu import nccl
    try:
        version = nccl.nccl_version_text(nccl.library())
    except nccl.NcclError:
        version = "unavailable"
    return f"{torch.cuda.get_device_name(device)} (NCCL {version})"


def gpu_transport() -> str:
    """The transport the engine agreed for the global set's GPU collectives (after one)."""
    from aiak_training.runtime import current
    gpu = getattr(getattr(current.engine(), "executor", None), "_gpu_executor", None)
    ctx = getattr(gpu, "_sets", {}).get(0) if gpu is not None else None
    return f"{ctx.transport} ({ctx.reason})" if ctx is not None else "unknown"


def on_device(fn: Callable[[], None], inner: int, barrier: Callable[[], None],
              device: torch.device) -> Callable[[], float]:
    """A sample: ``inner`` calls of ``fn`` run to completion on the device, per call."""
    def sample() -> float:
        barrier()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        elapsed = time.perf_counter() - start
        barrier()
        return elapsed / inner
    return sample


def torch_world_one(device: torch.device) -> None:
    """torch.distributed over NCCL (Gloo for --smoke-cpu), world size 1, rendezvous through
    a private file."""
    handle, path = tempfile.mkstemp(prefix="gpu_bench_store_")
    os.close(handle)
    os.unlink(path)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{path}", rank=0, world_size=1)


def ddp_buckets(grads: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """DDP's bucketing: gradients in reverse registration order (roughly the order backward
    produces them), a new bucket once one would exceed 25 MiB."""
    buckets, current, size = [], [], 0
    for g in reversed(grads):
        n = g.numel() * g.element_size()
        if current and size + n > BUCKET_BYTES:
            buckets.append(current)
            current, size = [], 0
        current.append(g)
        size += n
    if current:
        buckets.append(current)
    return buckets


def bench_grouped(args, hvd) -> None:
    dev = device_of(args)
    shapes = resnet50_shapes()[:20] if args.smoke_cpu else resnet50_shapes()
    gen = torch.Generator(device=dev).manual_seed(1)
    grads = [torch.randn(s, device=dev, generator=gen) for s in shapes]
    reference = [g.clone() for g in grads]
    hvd.grouped_allreduce_(grads, name="gpu_bench.rn50")
    sync(dev)
    # Average over one rank is the identity, exactly: the path ran and wrote every tensor.
    assert all(torch.equal(g, r) for g, r in zip(grads, reference)), "hvd result is wrong"

    torch_world_one(dev)
    world = dist.get_world_size()
    buckets = ddp_buckets(grads)

    def torch_buckets() -> None:
        for bucket in buckets:
            flat = torch.cat([g.view(-1) for g in bucket])
            flat.div_(world)
            dist.all_reduce(flat)
            torch._foreach_copy_(bucket, [v.view_as(g) for g, v in
                                          zip(bucket, flat.split([g.numel() for g in bucket]))])
    torch_buckets()
    sync(dev)
    assert all(torch.equal(g, r) for g, r in zip(grads, reference)), "torch result is wrong"

    inner = args.inner or 10
    barrier = lambda: sync(dev)  # noqa: E731
    variants = {
        "hvd_grouped_allreduce_": on_device(
            lambda: hvd.grouped_allreduce_(grads, name="gpu_bench.rn50"), inner, barrier, dev),
        "torch_ddp_buckets": on_device(torch_buckets, inner, barrier, dev),
    }
    times = interleave(variants, args.reps, args.warmup)
    total = sum(math.prod(s) for s in shapes) * 4
    params = {"hvd_grouped_allreduce_": {"bytes": total, "tensors": len(shapes), "inner": inner,
                                         "transport": gpu_transport()},
              "torch_ddp_buckets": {"bytes": total, "tensors": len(shapes), "inner": inner,
                                    "buckets": len(buckets), "bucket_bytes": BUCKET_BYTES}}
    results = [summarize(k, params[k], v) for k, v in times.items()]
    med = {r["name"]: r["median_s"] for r in results}
    ratios = {"gpu_grouped_vs_torch_buckets_1rank":
              med["torch_ddp_buckets"] / med["hvd_grouped_allreduce_"]}
    report("gpu_grouped_1rank", machine_info(1, "1x1", None, gpu=gpu_name(dev)), results,
           ratios, args.json)
    dist.destroy_process_group()


def encoder(layers: int) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(d_model=1024, nhead=16, dim_feedforward=4096,
                                             dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)


def bench_step(args, hvd) -> None:
    dev = device_of(args)
    if args.smoke_cpu:
        args.layers, args.batch, args.seq = 1, 2, 16
    torch.manual_seed(0)
    base = encoder(args.layers).to(dev)
    n_params = sum(p.numel() for p in base.parameters())
    models = {name: copy.deepcopy(base) for name in ("plain", "hvd", "ddp")}
    del base
    x = torch.randn(args.batch, args.seq, 1024, device=dev)

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=1e-5, momentum=0.9)
    opts = {"plain": sgd(models["plain"])}
    opt = hvd.DistributedOptimizer(sgd(models["hvd"]),
                                   named_parameters=models["hvd"].named_parameters())
    if not opt._grad_accs:  # the 1-rank short-cut (module doc): measure the real path
        opt._register_hooks()
    assert opt._grad_accs, "hvd.DistributedOptimizer has no gradient hooks"
    opts["hvd"] = opt
    torch_world_one(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(
        models["ddp"], device_ids=[dev.index] if dev.type == "cuda" else None)
    opts["ddp"] = sgd(ddp)
    runners = {"plain": models["plain"], "hvd": models["hvd"], "ddp": ddp}

    def step(name: str) -> Callable[[], None]:
        model, optimizer = runners[name], opts[name]

        def run() -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out = model(x)
            out.float().pow(2).mean().backward()
            optimizer.step()
        return run

    inner = args.inner or 5
    barrier = lambda: sync(dev)  # noqa: E731
    variants = {
        "plain": on_device(step("plain"), inner, barrier, dev),
        "hvd_distributed_optimizer": on_device(step("hvd"), inner, barrier, dev),
        "torch_ddp": on_device(step("ddp"), inner, barrier, dev),
    }
    times = interleave(variants, args.reps, args.warmup)
    common = {"params": n_params, "layers": args.layers, "batch": args.batch, "seq": args.seq,
              "autocast": "bfloat16", "optimizer": "SGD(momentum=0.9)", "inner": inner}
    results = [summarize(k, dict(common, **({"transport": gpu_transport(),
                                             "hooks_registered_by_benchmark": True}
                                            if k == "hvd_distributed_optimizer" else {})), v)
               for k, v in times.items()]
    med = {r["name"]: r["median_s"] for r in results}
    plain, hvd_s, ddp_s = med["plain"], med["hvd_distributed_optimizer"], med["torch_ddp"]
    ratios = {"gpu_step_overhead": hvd_s / plain,
              "gpu_step_overhead_vs_ddp_ms": ((hvd_s - plain) - (ddp_s - plain)) * 1e3,
              "gpu_step_overhead_hvd_ms": (hvd_s - plain) * 1e3,
              "gpu_step_overhead_ddp_ms": (ddp_s - plain) * 1e3}
    report("gpu_step_overhead_1rank", machine_info(1, "1x1", None, gpu=gpu_name(dev)),
           results, ratios, args.json)
    dist.destroy_process_group()


def bench_staged(args, hvd) -> None:
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != 2:
        raise SystemExit(f"--bench staged runs at 2 ranks (mpiexec -n 2), not {size}")
    dev = device_of(args)
    shapes = resnet50_shapes()[:20] if args.smoke_cpu else resnet50_shapes()
    # Small integers: sums are exact in float32, so results are checked bit for bit.
    grads = [torch.full(s, float(rank + 1), device=dev) + torch.arange(
        math.prod(s), device=dev, dtype=torch.float32).remainder(7).view(s) for s in shapes]
    expected = [sum(torch.full(s, float(r + 1), device=dev) for r in range(size)) +
                size * torch.arange(math.prod(s), device=dev,
                                    dtype=torch.float32).remainder(7).view(s) for s in shapes]
    total = sum(math.prod(s) for s in shapes)
    flat = torch.cat([g.view(-1) for g in grads])
    flat_expected = torch.cat([e.view(-1) for e in expected])
    pinned = torch.empty(total, dtype=torch.float32, pin_memory=dev.type == "cuda")
    host = pinned.numpy()
    landing = torch.empty_like(flat)
    outputs: Dict[str, list] = {}
    verified = {"hvd": 0, "floor": 0}  # tensors found equal to their expected sums

    def hvd_staged() -> None:
        outputs["hvd"] = hvd.grouped_allreduce(grads, op=hvd.Sum, name="gpu_bench.staged")

    def floor() -> None:
        pinned.copy_(flat, non_blocking=True)
        sync(dev)
        comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        landing.copy_(pinned, non_blocking=True)

    def check() -> None:
        sync(dev)
        assert all(torch.equal(o, e) for o, e in zip(outputs["hvd"], expected)), \
            "the staged allreduce gave a wrong result"
        assert torch.equal(landing, flat_expected), "the floor gave a wrong result"
        verified["hvd"] += len(expected)
        verified["floor"] += 1

    hvd_staged()
    floor()
    check()
    transport = gpu_transport()
    if dev.type == "cuda" and not transport.startswith("mpi"):
        raise SystemExit(f"expected the staged (mpi) transport for 2 ranks on one GPU, got "
                         f"{transport}")

    def barrier() -> None:
        sync(dev)
        comm.Barrier()
    inner = args.inner or 2
    variants = {"hvd_staged_grouped_allreduce": on_device(hvd_staged, inner, barrier, dev),
                "floor_d2h_mpi_h2d": on_device(floor, inner, barrier, dev)}
    times = interleave(variants, args.reps, args.warmup)
    check()  # the last timed results too
    gathered = comm.gather(times, root=0)
    if rank != 0:
        return
    # A collective takes as long as its slowest rank: per repetition, the max over ranks.
    slowest = {k: [max(t[k][i] for t in gathered) for i in range(args.reps)] for k in times}
    params = {"hvd_staged_grouped_allreduce": {"bytes": total * 4, "tensors": len(shapes),
                                               "inner": inner, "transport": transport,
                                               "checked_tensors": verified["hvd"]},
              "floor_d2h_mpi_h2d": {"bytes": total * 4, "tensors": 1, "inner": inner,
                                    "checked_tensors": verified["floor"]}}
    results = [summarize(k, params[k], v) for k, v in slowest.items()]
    med = {r["name"]: r["median_s"] for r in results}
    ratios = {"gpu_staged_2ranks_vs_floor":
              med["hvd_staged_grouped_allreduce"] / med["floor_d2h_mpi_h2d"]}
    report("gpu_staged_2ranks", machine_info(2, "1x2 (one GPU)", None, gpu=gpu_name(dev)),
           results, ratios, args.json)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.smoke_cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA device (torch.cuda.is_available() is "
                         "False); --smoke-cpu checks the script on CPU tensors")
    import aiak_training.torch as hvd
    hvd.init()
    if not args.smoke_cpu:
        # Ranks that share a GPU (the staged benchmark) all use device 0.
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count()
                              if args.bench != "staged" else 0)
    {"grouped": bench_grouped, "step": bench_step, "staged": bench_staged}[args.bench](args, hvd)
    hvd.shutdown()


if __name__ == "__main__":
    main()
