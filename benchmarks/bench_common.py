"""Shared pieces of the benchmarks: machine header, interleaved timing, JSON output.

Conventions: docs/benchmarks/index.md.  A and B are timed in the same launch, alternating,
after warm-up; the median of the timed repetitions is reported.
"""
import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def link_gbit(explicit: Optional[float] = None) -> Optional[float]:
    """The link rate to report: ``explicit`` if given, else the emulated cluster's
    (``AIAK_CLUSTER_LINK_GBIT``, set by ``aiak_training.testing.cluster``), else None."""
    if explicit is not None:
        return explicit
    from aiak_training.common.env import env_float
    rate = env_float("AIAK_CLUSTER_LINK_GBIT", 0.0, minimum=0.0)
    return rate or None


def machine_info(ranks: int = 1, layout: Optional[str] = None,
                 link_gbit: Optional[float] = None, gpu: Optional[str] = None) -> Dict:
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    try:
        from mpi4py import MPI
        mpi = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # noqa: BLE001 - a header must never break a benchmark
        mpi = None
    return {"cores": os.cpu_count(), "cpu": cpu_model(), "gpu": gpu, "mpi": mpi,
            "torch": torch_version, "ranks": ranks, "layout": layout or f"1x{ranks}",
            "link_gbit": link_gbit}


def resnet50_shapes() -> List[Tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-50: 161 tensors, 25,557,032 elements."""
    shapes: List[Tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (width * 4, width, 1, 1), (width * 4,), (width * 4,)]
            if b == 0:
                shapes += [(width * 4, inplanes, 1, 1), (width * 4,), (width * 4,)]
            inplanes = width * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def interleave(variants: Dict[str, Callable[[], float]], reps: int, warmup: int,
               rotate: bool = False) -> Dict[str, List[float]]:
    """Run each variant ``warmup`` times, then ``reps`` timed rounds A B C A B C ... (with
    ``rotate``, A B C, B C A, C A B, ...: no variant always follows the same one).

    Each callable returns its own elapsed seconds (so it can exclude setup)."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times: Dict[str, List[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(reps):
        shift = rep % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            times[name].append(variants[name]())
    return times


def summarize(name: str, params: Dict, samples: Sequence[float]) -> Dict:
    return {"name": name, "params": params, "median_s": statistics.median(samples),
            "min_s": min(samples), "max_s": max(samples), "reps": len(samples)}


def report(benchmark: str, machine: Dict, results: List[Dict], ratios: Dict[str, float],
           json_path: Optional[str]) -> None:
    print(f"# {benchmark}")
    print("# machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    print(f"{'variant':<44} {'median ms':>10} {'min ms':>10} {'max ms':>10} {'reps':>5}")
    for r in results:
        print(f"{r['name']:<44} {r['median_s'] * 1e3:>10.3f} {r['min_s'] * 1e3:>10.3f} "
              f"{r['max_s'] * 1e3:>10.3f} {r['reps']:>5}")
    print("ratios (above 1 means aiak-training is better):")
    for k, v in ratios.items():
        print(f"  {k} = {v:.3f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"benchmark": benchmark, "machine": machine, "results": results,
                       "ratios": ratios}, f, indent=2)


def timed(fn: Callable[[], None], barrier: Callable[[], None]) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start
