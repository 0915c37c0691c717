#!/usr/bin/env python
"""Fused optimizer benchmark: aiak_training.fused_optim against torch.optim, one process.

Follows docs/benchmarks/index.md: every variant of a case is timed in the same run,
interleaved with the order rotated every repetition (A B C, B C A, ...), after warm-up
steps; the median of --reps repetitions is reported, with a table on stdout headed by the
machine and, with --json PATH, the same figures as JSON.

Parameter sets
  resnet50  the 161 parameter tensors of torchvision's ResNet-50 (25,557,032 params), built
            from the architecture here (no torchvision needed).
  host      161 one-element tensors (ResNet-50's tensor count, no memory traffic): a step's
            time is its host cost.  Only with --cases ...,host; keys end in _host.
  cuda_stub the host side of a CUDA step, measured without a GPU: the same 161 one-element
            CPU tensors, with the plans' CUDA branch switched on and the CUDA library replaced
            by a stub whose entry points return at once (so the library's own argument
            packing and the launches are not included).  FusedAdam and FusedLAMB, each with
            its cached plans and with plan caching off (every step gathers per parameter).
            Only with --cases ...,cuda_stub; host-only figures, never GPU figures.
  large     a 1B-parameter GPT-style layout (20 layers, hidden 2048, 4x MLP, vocab 32000, so
            ~1.07B params) with the hidden size scaled down so that it holds about
            --large-params parameters (default 64M on CPU, 500M on CUDA): a few large
            tensors, the bandwidth-bound case.

Variants (CPU; each has its own params, grads and states; grads are fixed random values.
The four compared optimizers below each run as two copies, one created in a first pass and
one in a second pass in reverse order, stepped in turn: see Mirrored)
  fused_adam          aiak FusedAdam (lr 1e-3, defaults)
  torch_adam_fused    torch.optim.Adam(fused=True)
  torch_adam_forloop  torch.optim.Adam(foreach=False)
  fused_sgd           aiak FusedSGD(momentum=0.9)
  torch_sgd_foreach   torch.optim.SGD(momentum=0.9, foreach=True)
  memcpy              dst.copy_(src) of a buffer as large as Adam's four fp32 arrays
                      (bandwidth counts bytes read + bytes written), same thread count
  inplace_scale       dst.mul_(1.0) over that buffer (in-place read + write)
With --device cuda: fused_adam, torch_adam_fused, torch_adam_foreach, a device-to-device copy
and an in-place scale.  Each timed step is measured twice at once:
  host    wall time of the step() call on the host (the time to issue its work), taken while
          the GPU is still busy with a long sleep kernel queued just before, so that no launch
          waits for the device;
  device  CUDA events recorded before and after the step on the current stream.  The sleep
          kernel ahead of them means the step's kernels are all queued when the first one
          starts, so the span holds no host gaps: it is the device time alone.
The sleep is calibrated to be several times longer than a step's host time; each result
records whether it did cover the host time (host_hidden).

Patterns (CPU, --pattern): what precedes each timed step.  On the 2-vCPU VMs it moves the
results more than any kernel change: a step's time depends on whether the other vCPU is free
when its helper threads wake, and torch's OpenMP threads spin on it for a while after every
torch op.
  interleaved     (default) one step per variant per round: each step follows another
                  variant's step, of this library or of torch;
  after_torch_op  the same, with an untimed torch op over 16 MiB on all threads just before
                  each step, as the backward pass before an optimizer call leaves it;
  blocks          --block steps per variant per round, the first of each turn untimed (it
                  follows another variant): each optimizer in its own steady state.

GPU check interface (benchmarks/gpu_check.sh):
  python3 benchmarks/fused_optim_bench.py --device cuda --json benchmarks/results/X.json
  [--cases resnet50,large] [--large-params 5e8] [--reps 7]
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import aiak_training.fused_optim as fo  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info as _machine_info, resnet50_shapes  # noqa: E402

RATIO_HELP = """\
ratios (a value above 1 means aiak is better; keys without a suffix are from the resnet50
case, keys ending in _large from the large case, _host from the host case):
  adam_vs_torch_fused_cpu       torch Adam(fused=True) median step time / FusedAdam median
                                step time.  Target >= 1.0.
  adam_vs_torch_forloop_cpu     torch Adam(foreach=False) time / FusedAdam time.  Target >= 3.
  sgd_vs_torch_foreach_cpu      torch SGD(momentum=0.9, foreach=True) time / FusedSGD time.
                                Target >= 1.5.
  adam_bandwidth_fraction_cpu   FusedAdam bytes/s (28 bytes per fp32 param: p, g, m, v read,
                                p, m, v written) / memcpy bandwidth measured in the same run
                                (2 x buffer bytes per copy).  Target >= 0.6.
  adam_bandwidth_fraction_vs_inplace_cpu
                                FusedAdam bytes/s / bandwidth of an in-place x.mul_(1.0)
                                over the same buffer (8 bytes per element): a stricter
                                ceiling, since a copy's destination costs extra write-allocate
                                reads that the bytes count does not include.  No target.
  adam_plan_host_speedup_cuda_stub, lamb_plan_host_speedup_cuda_stub
                                (--cases cuda_stub) host time of a CUDA-branch step with plan
                                caching off / with the cached plans, the CUDA library stubbed.
                                Host only; no target.
  adam_vs_torch_fused_cuda_host   (--device cuda) torch Adam(fused=True) host issue time /
                                FusedAdam host issue time.  Target >= 1.0.
  adam_vs_torch_fused_cuda_device (--device cuda) the same with device times.  Target >= 1.0.
  adam_vs_torch_fused_cuda      (--device cuda) the smaller of the two above (>= 1.0 means
                                both targets are met).
  adam_bandwidth_fraction_cuda  (--device cuda) FusedAdam bytes/s / device-to-device copy
                                bandwidth, both by device time (and ..._vs_inplace_cuda as on
                                CPU).
"""

class _StubCudaLib:
    """Stands in for libaiak_fused_cuda.so in the cuda_stub case: every entry point returns
    success at once, so the timed step() is the host work before the library."""

    def __getattr__(self, name):
        return lambda *args: 8 if name.endswith("_workspace_bytes") else 0


class _NoPlanCache:
    """A plan cache that keeps nothing: the per-parameter path on every step."""

    def __init__(self, cache_cls):
        self._inner = cache_cls()

    def lookup(self, *args):
        return self._inner.lookup(*args)

    def store(self, plan):
        pass

    def clear(self):
        pass


def stub_cuda_variants(shapes, common) -> List["Variant"]:
    """The cuda_stub case (module docstring): patches this process for CUDA tables on CPU
    tensors; run it last."""
    import contextlib
    from aiak_training.fused_optim import _backend as B
    from aiak_training.fused_optim import _plan as P
    stub = _StubCudaLib()
    P.uses_cuda_tables = lambda device: True
    B.cuda_lib = lambda: stub
    B.cuda_stream = lambda device: 0
    torch.cuda.device = lambda device: contextlib.nullcontext()
    out = []
    for name, make in (("fused_adam", lambda ps: fo.FusedAdam(ps, lr=1e-3)),
                       ("fused_lamb", lambda ps: fo.FusedLAMB(ps, lr=1e-3))):
        for planned in (True, False):
            def make_opt(ps, make=make, planned=planned):
                opt = make(ps)
                if not planned:
                    opt.__dict__["_aiak_plans"] = _NoPlanCache(P.PlanCache)
                return opt
            label = f"{name}_{'planned' if planned else 'unplanned'}"
            out.append(Variant(label, make_adam_like(make_opt, shapes, "cpu"), 0,
                               dict(common, bytes=0, impl=f"aiak {label}, CUDA library stubbed")))
    return out


ADAM_BYTES = 28  # fp32: read p, g, m, v; write p, m, v
SGD_BYTES = 20   # fp32 momentum SGD: read p, g, buf; write p, buf


# ---------------------------------------------------------------------------- parameter sets
def gpt_shapes(hidden: int, layers: int = 20, vocab: int = 32000) -> List[Tuple[int, ...]]:
    h = hidden
    shapes: List[Tuple[int, ...]] = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,),
                   (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    shapes += [(h,), (h,)]
    return shapes


def large_shapes(target: int) -> List[Tuple[int, ...]]:
    """The 1B layout with the largest hidden size (multiple of 64) fitting `target` params."""
    hidden = 64
    while sum(math.prod(s) for s in gpt_shapes(hidden + 64)) <= target:
        hidden += 64
    return gpt_shapes(hidden)


# ---------------------------------------------------------------------------------- timing
class Variant:
    def __init__(self, name: str, fn: Callable[[], None], bytes_moved: int, params: Dict):
        self.name, self.fn, self.bytes_moved, self.params = name, fn, bytes_moved, params
        self.times: List[float] = []        # CPU: wall time; CUDA: device time (events)
        self.host_times: List[float] = []   # CUDA: host issue time
        self.hidden: List[bool] = []        # CUDA: the sleep covered the host issue time


def sleep_cycles_for(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep needs to keep the device busy ~``seconds``."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm-up: module load
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    per_s = probe / (start.elapsed_time(end) / 1e3)
    return int(per_s * seconds)


def time_cuda_step(v: "Variant", sleep_cycles: int, sleep_s: float) -> None:
    """One step of v: host issue time with the GPU kept busy, and device time by events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)  # the device is busy while the step is issued
    start.record()
    t0 = time.perf_counter()
    v.fn()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    v.host_times.append(host)
    v.times.append(start.elapsed_time(end) / 1e3)
    v.hidden.append(host < sleep_s)


def make_adam_like(make_opt, shapes, device, dtype=torch.float32, seed=0):
    """Step function of an optimizer over fresh params with fixed random grads on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    ps = [torch.randn(s, generator=g, device=device, dtype=dtype).requires_grad_() for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, device=device, dtype=dtype) * 1e-2
    opt = make_opt(ps)
    return opt.step


def run_case(case: str, shapes, args) -> List[Variant]:
    dev = args.device
    n = sum(math.prod(s) for s in shapes)
    common = {"case": case, "tensors": len(shapes), "numel": n, "dtype": "float32",
              "threads": torch.get_num_threads(), "device": dev,
              "pattern": args.pattern if dev == "cpu" else "interleaved",
              "thread_pool": fo._cpu_ext.threads_backend() if fo._cpu_ext is not None else None}
    if dev == "cpu" and args.pattern == "blocks":
        common["block"] = args.block
    vs: List[Variant] = []
    if case == "cuda_stub":
        vs = stub_cuda_variants(shapes, dict(common, device="cpu (CUDA library stubbed)"))
    else:
        add_variants(vs, shapes, dev, n, common)
    return time_variants(vs, dev, args)


class Mirrored:
    """Two copies of one CPU variant, stepped in turn (one per repetition).

    On the Zen 5 VMs a copy's step time depended on where in the run its tensors were created,
    by up to 10% (11-27: two FusedAdam copies 1.10x apart, interleaved).  The compared
    optimizers therefore each get one copy created in the first pass and one in a second pass
    in reverse order (A B ... B A), so that neither side owns the favourable places."""

    def __init__(self, first: Callable[[], None]) -> None:
        self.fns = [first]
        self.calls = 0

    def __call__(self) -> None:
        fn = self.fns[self.calls % len(self.fns)]
        self.calls += 1
        fn()


def add_variants(vs: List[Variant], shapes, dev: str, n: int, common: Dict) -> None:
    """The optimizer and bandwidth variants of a resnet50, large or host case."""
    makers: List[Tuple[Mirrored, Callable[[], Callable[[], None]]]] = []

    def add(name, fn, nbytes, **extra):
        vs.append(Variant(name, fn, nbytes, dict(common, bytes=nbytes, **extra)))

    def add_mirrored(name, make, nbytes, **extra):
        if dev != "cpu":  # the CUDA case has no room for second copies of the large set
            add(name, make(), nbytes, **extra)
            return
        fn = Mirrored(make())
        makers.append((fn, make))
        add(name, fn, nbytes, copies=2, **extra)

    add_mirrored("fused_adam", lambda: make_adam_like(lambda ps: fo.FusedAdam(ps, lr=1e-3), shapes, dev),
                 ADAM_BYTES * n, impl="aiak FusedAdam",
                 isa=fo.cpu_isa(torch.get_num_threads()) if dev == "cpu" else "cuda")
    add_mirrored("torch_adam_fused",
                 lambda: make_adam_like(lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), shapes, dev),
                 ADAM_BYTES * n, impl="torch.optim.Adam(fused=True)")
    if dev == "cpu":
        add("torch_adam_forloop",
            make_adam_like(lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False), shapes, dev),
            ADAM_BYTES * n, impl="torch.optim.Adam(foreach=False)")
        add_mirrored("fused_sgd",
                     lambda: make_adam_like(lambda ps: fo.FusedSGD(ps, lr=1e-3, momentum=0.9), shapes, dev),
                     SGD_BYTES * n, impl="aiak FusedSGD(momentum=0.9)")
        add_mirrored("torch_sgd_foreach",
                     lambda: make_adam_like(
                         lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True), shapes, dev),
                     SGD_BYTES * n, impl="torch.optim.SGD(momentum=0.9, foreach=True)")
    else:
        add("torch_adam_foreach",
            make_adam_like(lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True), shapes, dev),
            ADAM_BYTES * n, impl="torch.optim.Adam(foreach=True)")
    src = torch.randn(4 * n, device=dev)
    dst = torch.empty_like(src)
    add("memcpy", lambda: dst.copy_(src), 2 * src.numel() * 4,
        impl="torch copy_ (device-to-device)" if dev == "cuda" else "torch copy_")
    # A stricter ceiling for in-place read-modify-write streams like Adam's: no write-allocate
    # traffic for a separate destination.
    add("inplace_scale", lambda: dst.mul_(1.0), 2 * dst.numel() * 4, impl="torch mul_ in place")
    for fn, make in reversed(makers):  # the second copies, in reverse order (see Mirrored)
        fn.fns.append(make())


def time_variants(vs: List[Variant], dev: str, args) -> List[Variant]:
    """Warm-up, then the interleaved repetitions with the order rotated (module docstring)."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for v in vs:  # warm-up: lazy state allocation, first-touch page faults, thread pools
        for _ in range(args.warmup * (len(v.fn.fns) if isinstance(v.fn, Mirrored) else 1)):
            v.fn()
    sync()
    sleep_cycles, sleep_s = 0, 0.0
    scratch = torch.ones(4 << 20) if args.pattern == "after_torch_op" else None  # 16 MiB

    def torch_op() -> None:
        """Torch intra-op work on all threads, as the backward pass before a training
        step's optimizer call leaves it (torch's OpenMP threads still spinning)."""
        scratch.mul_(1.0)
    if dev == "cuda":
        # Keep the GPU busy for several times the slowest host issue time seen in warm-up.
        longest = 0.0
        for v in vs:
            t0 = time.perf_counter()
            v.fn()
            longest = max(longest, time.perf_counter() - t0)
            sync()
        sleep_s = max(0.02, 5 * longest)
        sleep_cycles = sleep_cycles_for(sleep_s)
    for rep in range(args.reps):
        # Interleaved, and the order rotates every repetition (A B C, B C A, C A B, ...): on the
        # 2-vCPU VMs a variant's place in the round moved its time by several percent.
        k = rep % len(vs)
        for v in vs[k:] + vs[:k]:
            if dev == "cuda":
                time_cuda_step(v, sleep_cycles, sleep_s)
            elif args.pattern == "blocks":
                v.fn()  # follows another variant's steps: untimed
                for _ in range(args.block):
                    t0 = time.perf_counter()
                    v.fn()
                    v.times.append(time.perf_counter() - t0)
            else:
                if args.pattern == "after_torch_op":
                    torch_op()
                t0 = time.perf_counter()
                v.fn()
                v.times.append(time.perf_counter() - t0)
    return vs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, epilog=RATIO_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per variant (>= 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (the fused CPU kernels follow it); default: torch's")
    ap.add_argument("--large-params", type=float, default=None,
                    help="parameter budget of the large case (default 64e6 on CPU, 5e8 on CUDA, "
                         "so that three optimizers and the copy buffers fit in 80 GB)")
    ap.add_argument("--cases", default="resnet50,large",
                    help="comma-separated subset of resnet50,large,host (host: 161 one-element "
                         "tensors, so a step's time is its host cost; not run by default)")
    ap.add_argument("--pattern", choices=("interleaved", "after_torch_op", "blocks"),
                    default="interleaved",
                    help="CPU only, how steps are timed (see Patterns): one step per variant "
                         "per round (default); the same after an untimed torch op; or "
                         "--block steps per variant per round, the first untimed")
    ap.add_argument("--block", type=int, default=10, help="steps timed per turn (blocks)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args()
    if args.reps < 5:
        ap.error("--reps must be >= 5")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.large_params is None:
        args.large_params = 64e6 if args.device == "cpu" else 5e8

    cases = {"resnet50": resnet50_shapes(), "large": large_shapes(int(args.large_params)),
             "host": [(1,)] * len(resnet50_shapes()),
             "cuda_stub": [(1,)] * len(resnet50_shapes())}
    selected = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in selected if c not in cases]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {sorted(cases)}")
    if "cuda_stub" in selected:  # it patches the process: run it last
        if args.device != "cpu":
            ap.error("--cases cuda_stub runs on CPU tensors only (no --device cuda)")
        selected = [c for c in selected if c != "cuda_stub"] + ["cuda_stub"]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() \
        else None
    machine = dict(_machine_info(1, gpu=gpu), torch=torch.__version__.split("+")[0])
    results, by_key = [], {}
    for case in selected:
        for v in run_case(case, cases[case], args):
            med = statistics.median(v.times)
            host = statistics.median(v.host_times) if v.host_times else None
            by_key[(case, v.name)] = (med, v.bytes_moved, host)
            row = {"name": f"{case}/{v.name}", "params": v.params, "median_s": med,
                   "min_s": min(v.times), "max_s": max(v.times), "reps": len(v.times)}
            if v.host_times:  # CUDA: median_s is the device time
                row.update(timing="device time by CUDA events, GPU kept busy ahead",
                           host_median_s=host, host_min_s=min(v.host_times),
                           host_max_s=max(v.host_times), host_hidden=all(v.hidden))
            results.append(row)
            del v
        if args.device == "cuda":
            torch.cuda.empty_cache()
    sfx = "cpu" if args.device == "cpu" else "cuda"
    ratios = {}
    for case in selected:
        tail = "" if case == "resnet50" else f"_{case}"
        if case == "cuda_stub":
            for opt in ("adam", "lamb"):
                ratios[f"{opt}_plan_host_speedup_cuda_stub"] = (
                    by_key[(case, f"fused_{opt}_unplanned")][0] / by_key[(case, f"fused_{opt}_planned")][0])
            continue

        def med(name):
            return by_key[(case, name)][0]

        bw = lambda name: by_key[(case, name)][1] / by_key[(case, name)][0]  # noqa: E731
        if args.device == "cuda":
            host = lambda name: by_key[(case, name)][2]  # noqa: E731
            r_host = host("torch_adam_fused") / host("fused_adam")
            r_dev = med("torch_adam_fused") / med("fused_adam")
            ratios[f"adam_vs_torch_fused_cuda_host{tail}"] = r_host
            ratios[f"adam_vs_torch_fused_cuda_device{tail}"] = r_dev
            ratios[f"adam_vs_torch_fused_cuda{tail}"] = min(r_host, r_dev)
        else:
            ratios[f"adam_vs_torch_fused_cpu{tail}"] = med("torch_adam_fused") / med("fused_adam")
        if args.device == "cpu":
            ratios[f"adam_vs_torch_forloop_cpu{tail}"] = med("torch_adam_forloop") / med("fused_adam")
            ratios[f"sgd_vs_torch_foreach_cpu{tail}"] = med("torch_sgd_foreach") / med("fused_sgd")
        ratios[f"adam_bandwidth_fraction_{sfx}{tail}"] = bw("fused_adam") / bw("memcpy")
        ratios[f"adam_bandwidth_fraction_vs_inplace_{sfx}{tail}"] = bw("fused_adam") / bw("inplace_scale")

    # ------------------------------------------------------------------------------ report
    print("# fused_optim_bench")
    print(f"# machine: cores={machine['cores']} cpu={machine['cpu']!r} gpu={machine['gpu']} "
          f"mpi={machine['mpi']!r} torch={machine['torch']} ranks=1 layout=1x1")
    print(f"# device={args.device} threads={torch.get_num_threads()} cpu_isa={fo.cpu_isa(torch.get_num_threads())} "
          f"reps={args.reps} warmup={args.warmup} (interleaved; median/min/max per step)")
    if args.device == "cuda":
        print("# median/min/max: device time (CUDA events, GPU busy ahead); host ms: issue time")
    print(f"{'variant':<30} {'tensors':>7} {'params':>12} {'median ms':>10} {'min ms':>9} "
          f"{'max ms':>9} {'GB/s':>7}" + (f" {'host ms':>8}" if args.device == "cuda" else ""))
    for r in results:
        p = r["params"]
        extra = ""
        if "host_median_s" in r:
            extra = f" {r['host_median_s'] * 1e3:>8.3f}" + ("" if r["host_hidden"] else " (not hidden)")
        print(f"{r['name']:<30} {p['tensors']:>7} {p['numel']:>12,} {r['median_s'] * 1e3:>10.2f} "
              f"{r['min_s'] * 1e3:>9.2f} {r['max_s'] * 1e3:>9.2f} "
              f"{p['bytes'] / r['median_s'] / 1e9:>7.2f}{extra}")
    print("ratios (>1 = aiak better; see --help):")
    for k, v in ratios.items():
        print(f"  {k:<40} {v:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "fused_optim", "machine": machine, "results": results,
                       "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
