"""Deep gradient compression benchmark: wire bytes, threshold selection, step time, accuracy.

Conventions: docs/benchmarks/index.md (interleaved A B A B timing after warm-up, medians,
--json).  Modes (--modes, comma-separated; default wire,select):

  wire    ResNet-50-shaped gradient set (161 tensors, 25.6M elements), SGD momentum 0.9 and
          weight decay 1e-4, DGC at density 0.001 after the paper's warm-up (5 steps here).
          Counts the bytes each rank hands to the collectives per step: the packed sparse
          segment (header, int32 indices, values) plus the dense allreduces (1-D tensors).
  select  threshold selection on one 16M-element (2**24) float32 tensor at density 0.001
          (k = 16,778), single thread: torch.topk against DGC's sampled selection.
  select-only
          (also the flag --select-only) DGC's compress and decompress of the ResNet-50
          gradient set on one device (--device cpu|cuda), density 0.001, SGD momentum 0.9
          and weight decay 1e-4: momentum correction, selection, masking, packing the
          slot-filled segment, and the scatter-add of that segment into the gradients, as
          one rank sees them (no collective).  One rank.  On CUDA each repetition ends with a
          device synchronize, so the time includes the device work.
  step    training steps of a ~25M-parameter MLP (1024-4096-4096-1024), batch 8 per rank,
          dense DistributedOptimizer against DGC at density 0.001 (steady state: warm-up off),
          both SGD momentum 0.9.  Meant for the emulated cluster (see below).

Ratios (above 1 means DGC is better):

  wire_bytes_reduction        dense bytes sent per rank per step (all gradients, fp32) divided
                              by DGC's bytes per rank per step (indices, values, headers and
                              the dense 1-D tensors all counted), at density 0.001 after
                              warm-up, ResNet-50 shapes.  Target >= 200.
  wire_bytes_reduction_fp16   the same with fp16_values=True.
  wire_bytes_reduction_ring_4ranks
                              the same payloads through the collectives' own traffic on 4
                              ranks with ring algorithms: a ring allreduce sends
                              2 (N-1)/N x S per rank, a ring allgather (N-1) x s (each rank
                              forwards every other rank's segment).  The allgather's cost grows
                              with N; this shows how much of the payload ratio is left at N=4.
  select_vs_topk_cpu          time of torch.topk(|x|, k) on a precomputed |x| (so the baseline
                              does not even pay for abs) divided by DGC's select_topk(x, k),
                              which includes abs.  Both single-threaded.  Target >= 3.
  dgc_<device>_select_ms      select-only mode: median milliseconds of one compress plus
                              decompress of the ResNet-50 set (dgc_cuda_select_ms: target
                              <= 3 on one H100/H200).  On CPU the compiled kernels run; the
                              torch-op path that runs on GPUs is timed on CPU as well
                              (dgc_cpu_torchops_select_ms), with its selections checked
                              against the compiled kernels'.
  step_speedup_1gbit          steps per second with DGC divided by steps per second with the
                              dense DistributedOptimizer, 4 ranks on the emulated 2 nodes x 2
                              ranks cluster at 1 Gbit/s.  Target >= 3.  (On a cluster of
                              another nominal rate the key is step_speedup_<rate>gbit.)
  digits_dgc_minus_dense_points
                              plot mode: DGC's mean final test accuracy minus dense's, in
                              points (the convergence test requires >= -1.0).

Run::

    mpiexec -n 1 python benchmarks/dgc_bench.py --modes wire,select --json dgc.json
    python3 benchmarks/dgc_bench.py --select-only --device cuda --json PATH
    python -m aiak_training.testing.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        mpiexec -n 4 python benchmarks/dgc_bench.py --modes step --layout 2x2 --json step.json
    mpiexec -n 4 python benchmarks/dgc_bench.py --modes plot \\
        --json benchmarks/results/dgc_digits_accuracy_<date>.json

The plot mode trains the digits MLP of the convergence test (benchmarks/jobs/dgc_digits.py,
which tests/parallel/test_dgc_convergence.py runs too: dense and DGC, 3 seeds, 4 ranks) and
plots test accuracy against epoch; its curves go to --json as well.
"""
import argparse
import math
import os
import sys
from typing import Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import aiak_training.torch as hvd  # noqa: E402
from aiak_training.dgc import _kernels, select_topk  # noqa: E402
from bench_common import (interleave, link_gbit, machine_info, report, resnet50_shapes,  # noqa: E402
                          summarize, timed)

SELECT_N = 1 << 24
DENSITY = 0.001


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="wire,select", help="wire,select,step,plot")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--step-reps", type=int, default=7)
    p.add_argument("--batch", type=int, default=8, help="step mode: per-rank batch")
    p.add_argument("--layout", help="layout string for the JSON header, e.g. 2x2")
    p.add_argument("--link-gbit", type=float, default=None,
                   help="link rate for the header (default: AIAK_CLUSTER_LINK_GBIT)")
    p.add_argument("--plot", metavar="PNG", help="plot mode: output PNG")
    p.add_argument("--select-only", action="store_true",
                   help="run only the select-only mode (DGC compress + decompress, one device)")
    p.add_argument("--device", default="cpu", help="select-only mode: cpu or cuda")
    p.add_argument("--epochs", type=int, default=30, help="plot mode: epochs")
    return p.parse_args()


def barrier() -> None:
    hvd.barrier()


# ---- wire ------------------------------------------------------------------------------------
def _wire_run(args, shapes, fp16: bool, warmup_steps: int):
    """DGC steps on ResNet-50-shaped random gradients; returns (step times, stats history)."""
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    named = [(f"p{i:03d}", p) for i, p in enumerate(params)]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4),
        named_parameters=named,
        compression=hvd.Compression.dgc(density=DENSITY, warmup_steps=warmup_steps,
                                        fp16_values=fp16))
    gen = torch.Generator().manual_seed(hvd.rank())
    history = []

    def step():
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        history.append(opt.dgc_stats())

    for _ in range(warmup_steps):
        step()
    assert opt.dgc_density() == DENSITY
    times = [timed(step, barrier) for _ in range(args.reps)]
    return times, history


def wire_mode(args, results: List[Dict], ratios: Dict[str, float]) -> None:
    shapes = resnet50_shapes()
    dense_bytes = 4 * sum(math.prod(s) for s in shapes)
    warmup_steps = 5
    sent = {}
    last32 = None
    for fp16 in (False, True):
        times, history = _wire_run(args, shapes, fp16, warmup_steps)
        last = history[-1]
        sent[fp16] = last["sparse_bytes"] + last["dense_bytes"]
        if not fp16:
            last32 = last
        results.append(summarize(
            f"dgc step, ResNet-50 shapes{', fp16 values' if fp16 else ''}",
            {"dense_bytes_per_step": dense_bytes, "dgc_bytes_per_step": sent[fp16],
             "sparse_segment_bytes": last["sparse_bytes"], "dense_1d_bytes": last["dense_bytes"],
             "pairs": last["selected"], "compressed_elements": last["compressed_elements"],
             "density": last["density"],
             "warmup_bytes_per_step": [h["sparse_bytes"] + h["dense_bytes"]
                                       for h in history[:warmup_steps]],
             "ranks": hvd.size()}, times))
    ratios["wire_bytes_reduction"] = dense_bytes / sent[False]
    ratios["wire_bytes_reduction_fp16"] = dense_bytes / sent[True]
    n = 4
    ring_dense = 2 * (n - 1) / n * dense_bytes
    ring_dgc = (n - 1) * last32["sparse_bytes"] + 2 * (n - 1) / n * last32["dense_bytes"]
    ratios["wire_bytes_reduction_ring_4ranks"] = ring_dense / ring_dgc


# ---- select ------------------------------------------------------------------------------------
def select_mode(args, results: List[Dict], ratios: Dict[str, float]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(SELECT_N, generator=torch.Generator().manual_seed(0))
        a = x.abs()
        k = math.ceil(DENSITY * SELECT_N)
        ours, _ = select_topk(x, k)
        ref = torch.sort(torch.topk(a, k).indices).values
        assert torch.equal(ours.long(), ref), "DGC selection differs from torch.topk"
        paths = []

        def run_ours():
            import time
            t = time.perf_counter()
            _, path = select_topk(x, k)
            dt = time.perf_counter() - t
            paths.append(path)
            return dt

        def run_topk():
            import time
            t = time.perf_counter()
            torch.topk(a, k)
            return time.perf_counter() - t

        def run_topk_abs():
            import time
            t = time.perf_counter()
            torch.topk(x.abs(), k)
            return time.perf_counter() - t

        def run_exact():
            import time
            t = time.perf_counter()
            select_topk(x, k, exact=True)
            return time.perf_counter() - t

        times = interleave({"topk": run_topk, "ours": run_ours, "topk_abs": run_topk_abs,
                            "exact": run_exact}, reps=args.reps, warmup=args.warmup)
    finally:
        torch.set_num_threads(threads)
    params = {"n": SELECT_N, "k": k, "dtype": "float32", "threads": 1}
    results.append(summarize("torch.topk(|x|, k), |x| precomputed", params, times["topk"]))
    results.append(summarize("torch.topk(x.abs(), k)", params, times["topk_abs"]))
    results.append(summarize(f"dgc select_topk sampled ({_kernels.isa()})",
                             {**params, "paths": sorted(set(paths))}, times["ours"]))
    results.append(summarize("dgc select_topk exact path", params, times["exact"]))
    med = {k_: sorted(v)[len(v) // 2] for k_, v in times.items()}
    ratios["select_vs_topk_cpu"] = med["topk"] / med["ours"]


# ---- select-only: compress and decompress on one device ----------------------------------------
def _select_only_run(args, device: torch.device, grads: List[torch.Tensor], shapes):
    """(times, sent pairs of the last rep) of DGC compress + decompress on ``device``."""
    from aiak_training.dgc.exchange import add_slots
    from aiak_training.dgc.wire import pack_slots
    params = [torch.zeros(s, device=device, requires_grad=True) for s in shapes]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4),
        named_parameters=[(f"p{i:03d}", p) for i, p in enumerate(params)],
        compression=hvd.Compression.dgc(density=DENSITY, warmup_densities=()))
    order = opt._dgc_sparse  # the compressed tensors, in exchange order
    grad_of = {id(p): g for p, g in zip(params, grads)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    last = []

    def once():
        import time
        for p in order:  # the same gradient every time, outside the timed part
            if p.grad is None:
                p.grad = grad_of[id(p)].clone()
            else:
                p.grad.copy_(grad_of[id(p)])
        sync()
        t = time.perf_counter()
        indices, values, sent, _ = opt._dgc_compress_all(DENSITY)
        buf = pack_slots(indices, values, opt._dgc_header(indices))
        outs = [p.grad.view(-1) for p in order]
        torch._foreach_zero_(outs)
        add_slots(buf, 1, outs, [int(i.numel()) for i in indices], [v.dtype for v in values])
        sync()
        last[:] = sent
        return time.perf_counter() - t
    return once, last, opt


def select_only_mode(args, results: List[Dict], ratios: Dict[str, float]) -> None:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    shapes = resnet50_shapes()
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    runs = {"native" if device.type == "cpu" and _kernels.native_available() else "torch":
            _select_only_run(args, device, grads, shapes)}
    if device.type == "cpu" and _kernels.native_available():
        # The GPU code on CPU tensors: the compiled kernels switched off for these steps.
        saved = _kernels.ext
        _kernels.ext = None
        try:
            runs["torch"] = _select_only_run(args, device, grads, shapes)
        finally:
            _kernels.ext = saved

    def timed_run(name):
        once = runs[name][0]
        if name == "torch" and "native" in runs:
            saved = _kernels.ext
            _kernels.ext = None
            try:
                return once()
            finally:
                _kernels.ext = saved
        return once()
    times = interleave({n: (lambda n=n: timed_run(n)) for n in runs}, reps=args.reps,
                       warmup=args.warmup)
    if "native" in runs:  # the same step sequence through both paths: the same pairs
        for (i0, v0), (i1, v1) in zip(runs["native"][1], runs["torch"][1]):
            assert torch.equal(i0, i1) and torch.equal(v0, v1), "device path differs"
    opt = runs["torch"][2] if "torch" in runs else runs["native"][2]
    base = {"device": str(device), "tensors_compressed": len(opt._dgc_sparse),
            "elements_compressed": sum(p.numel() for p in opt._dgc_sparse),
            "density": DENSITY,
            "pairs": sum(int(i.numel()) for i, _ in runs[next(iter(runs))][1])}
    if device.type == "cuda":
        base["gpu"] = torch.cuda.get_device_name(device)
    med = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
    for name in runs:
        label = "compiled kernels" if name == "native" else "torch ops (the GPU path)"
        results.append(summarize(f"dgc compress + decompress, ResNet-50 set, {label}",
                                 {**base, "path": name}, times[name]))
    if device.type == "cuda":
        ratios["dgc_cuda_select_ms"] = 1e3 * med["torch"]
    else:
        if "native" in med:
            ratios["dgc_cpu_select_ms"] = 1e3 * med["native"]
        ratios["dgc_cpu_torchops_select_ms"] = 1e3 * med["torch"]


# ---- step --------------------------------------------------------------------------------------
def make_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                               torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                               torch.nn.Linear(4096, 1024))


def step_mode(args, results: List[Dict], ratios: Dict[str, float]) -> None:
    torch.set_num_threads(1)
    runs = {}
    for name in ("dense", "dgc"):
        model = make_mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        compression = hvd.Compression.none if name == "dense" else \
            hvd.Compression.dgc(density=DENSITY, warmup_densities=())
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
        gen = torch.Generator().manual_seed(hvd.rank())
        x = torch.randn(args.batch, 1024, generator=gen)
        y = torch.randn(args.batch, 1024, generator=gen)

        def step(model=model, opt=opt, x=x, y=y):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        runs[name] = (step, model, opt)
    nparams = sum(p.numel() for p in runs["dense"][1].parameters())
    times = interleave({n: (lambda fn=fn: timed(fn, barrier)) for n, (fn, _, _) in runs.items()},
                       reps=args.step_reps, warmup=args.warmup)
    stats = runs["dgc"][2].dgc_stats()
    base = {"params": nparams, "batch_per_rank": args.batch, "ranks": hvd.size()}
    results.append(summarize("dense DistributedOptimizer step", {**base, "bytes": 4 * nparams},
                             times["dense"]))
    results.append(summarize("DGC step (density 0.001)",
                             {**base, "bytes": stats["sparse_bytes"] + stats["dense_bytes"]},
                             times["dgc"]))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    # The key names the nominal link rate of the emulated cluster (1 Gbit/s for the target).
    nominal = os.environ.get("AIAK_CLUSTER_NOMINAL_GBIT", "1")
    rate = f"{float(nominal):g}".replace(".", "p")
    ratios[f"step_speedup_{rate}gbit"] = med["dense"] / med["dgc"]


# ---- plot --------------------------------------------------------------------------------------
def plot_mode(args, results: List[Dict], ratios: Dict[str, float], extra: Dict) -> None:
    sys.path.insert(0, os.path.join(HERE, "jobs"))
    import time

    import dgc_digits as conv  # the convergence test's training code
    torch.set_num_threads(1)
    start = time.perf_counter()
    curves = conv.train_digits(variants=("dense", "dgc"), epochs=args.epochs)
    elapsed = time.perf_counter() - start
    extra["digits_curves"] = {v: {str(s): c for s, c in per_seed.items()}
                              for v, per_seed in curves.items()}
    finals = {v: [c[-1] for c in per_seed.values()] for v, per_seed in curves.items()}
    extra["digits_final_accuracy"] = finals
    extra["digits_wall_s"] = elapsed
    if hvd.rank() == 0:
        for v, accs in finals.items():
            print(f"digits {v}: final test accuracy per seed {[round(a, 2) for a in accs]}, "
                  f"mean {sum(accs) / len(accs):.2f} ({args.epochs} epochs, {elapsed:.0f} s)")
    ratios["digits_dgc_minus_dense_points"] = (sum(finals["dgc"]) - sum(finals["dense"])) / \
        len(finals["dgc"])
    if hvd.rank() != 0 or not args.plot:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    epochs = list(range(1, args.epochs + 1))
    zoom_from = args.epochs // 2
    for ax, first in ((axes[0], 0), (axes[1], zoom_from)):
        for v, color, label in (("dense", "tab:blue", "dense momentum SGD"),
                                ("dgc", "tab:red", f"DGC, density {conv.DENSITY} after warm-up")):
            runs = list(curves[v].values())
            span = range(first, args.epochs)
            mean = [sum(r[e] for r in runs) / len(runs) for e in span]
            lo = [min(r[e] for r in runs) for e in span]
            hi = [max(r[e] for r in runs) for e in span]
            ax.plot(epochs[first:], mean, color=color,
                    label=f"{label}: mean of {len(runs)} seeds, band = min..max")
            ax.fill_between(epochs[first:], lo, hi, color=color, alpha=0.2)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].axvspan(0.5, conv.WARMUP_EPOCHS + 0.5, color="grey", alpha=0.12,
                    label="DGC sparsity warm-up (75% to 99.6%)")
    axes[0].set_ylabel("test accuracy (%)")
    axes[0].set_ylim(0, 100)
    axes[0].legend(loc="lower right", fontsize=8)
    axes[0].set_title(f"digits MLP 64-128-64-10, {hvd.size()} ranks x batch "
                      f"{conv.PER_RANK_BATCH}, cosine LR", fontsize=10)
    axes[1].set_title(f"last {args.epochs - zoom_from} epochs (zoom)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


def main():
    args = parse_args()
    load_before = os.getloadavg()[0]  # the machine is shared: record how busy it was
    hvd.init()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.select_only:
        modes = ["select-only"]
    results: List[Dict] = []
    ratios: Dict[str, float] = {}
    extra: Dict = {}
    for mode in modes:
        if mode == "wire":
            wire_mode(args, results, ratios)
        elif mode == "select":
            if hvd.rank() == 0:  # a single-thread kernel benchmark: one rank is enough
                select_mode(args, results, ratios)
        elif mode == "select-only":
            select_only_mode(args, results, ratios)
        elif mode == "step":
            step_mode(args, results, ratios)
        elif mode == "plot":
            plot_mode(args, results, ratios, extra)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    if hvd.rank() == 0:
        link = link_gbit(args.link_gbit)
        machine = machine_info(hvd.size(), args.layout, link)
        machine["dgc_scan_isa"] = _kernels.isa()
        if args.device.startswith("cuda") and torch.cuda.is_available():
            machine["gpu"] = torch.cuda.get_device_name()
        machine["loadavg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        report("dgc_bench", machine, results, ratios, args.json)
        if args.json and extra:
            import json
            with open(args.json) as f:
                data = json.load(f)
            data.update(extra)
            with open(args.json, "w") as f:
                json.dump(data, f, indent=2)
    hvd.barrier()  # other ranks' shutdown would stop rank 0's engine while it still reports
    hvd.shutdown()


if __name__ == "__main__":
    main()
