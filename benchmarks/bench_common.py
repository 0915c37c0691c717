"""The benchmarks' harness: machine header, model shapes, interleaved timing, JSON output,
and launching the child jobs a driver script runs (:func:`mpiexec`, :func:`child_env`,
:func:`run_jobs`, :func:`run_json_job`).

Conventions: docs/benchmarks/index.md.  A and B are timed in the same launch, alternating,
after warm-up; the median of the timed repetitions is reported.  Benchmarks import this
module, never ``tests/``; the per-rank programs and modules that benchmarks and tests both
run live in ``benchmarks/jobs/`` (tests/test_benchmarks_layout.py keeps it so).
"""
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


def mpiexec() -> str:
    """The MPI launcher: the one installed beside this Python (``pip install mpich``), else
    the first on ``PATH``."""
    for candidate in (os.path.join(sysconfig.get_path("scripts"), "mpiexec"),
                      shutil.which("mpiexec")):
        if candidate and os.path.exists(candidate):
            return candidate
    raise RuntimeError("mpiexec not found: install an MPI (pip install mpich)")


def run_jobs(cmds: Sequence[Sequence[str]], what: str, timeout: Optional[float] = None,
             env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
             stream: bool = False, check: bool = True, expect: int = 0,
             writes: Sequence[str] = ()) -> int:
    """Start ``cmds`` together (the processes of one job: one command, or one per rank) and
    wait for all of them, for at most ``timeout`` seconds in all; returns the first nonzero
    exit status, or 0 (-9 for a process killed at the timeout).  They read no input.

    Their output goes to a log.  The job fails when time runs out (the others are killed),
    when its status is not ``expect`` (1, say, for a job that is meant to end with an error)
    or when a file of ``writes`` (its JSON) is missing afterwards; the log's end is then shown
    and the benchmark stops (``SystemExit`` naming ``what``).  With ``stream`` the output goes
    to the terminal instead, each command echoed first, and a failure exits with the failed
    process's status.  With ``check`` False a failure is only returned (for jobs whose
    failure is what is measured)."""
    with tempfile.TemporaryFile("w+") as log:
        out = None if stream else log
        procs = []
        for cmd in cmds:
            if stream:
                print("+ " + " ".join(cmd), flush=True)
            procs.append(subprocess.Popen(list(cmd), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                          stdout=out,
                                          stderr=None if stream else subprocess.STDOUT))
        deadline = None if timeout is None else time.monotonic() + timeout
        status = 0
        try:
            for proc in procs:
                left = None if deadline is None else max(1.0, deadline - time.monotonic())
                try:
                    rc = proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    rc = -9
                status = status or rc
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        missing = [path for path in writes if not os.path.exists(path)]
        if (status == expect and not missing) or not check:
            return status
        if stream and status != expect:
            raise SystemExit(status or 1)
        if not stream:
            log.seek(0)
            sys.stderr.write(log.read()[-8000:])
        if status != expect:
            raise SystemExit(f"{what} failed (exit {status})")
        raise SystemExit(f"{what} wrote no {', '.join(missing)} (exit {status})")


def read_json(path: str) -> Any:
    """The JSON a child job wrote to ``path``."""
    with open(path) as f:
        return json.load(f)


def run_json_job(cmds: Sequence[Sequence[str]], out: str, what: str,
                 timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None, stream: bool = False) -> Any:
    """:func:`run_jobs`, then the JSON the job wrote to ``out``."""
    run_jobs(cmds, what, timeout=timeout, env=env, cwd=cwd, stream=stream, writes=[out])
    return read_json(out)


def child_env(*paths: str, drop: Sequence[str] = (), **extra: str) -> Dict[str, str]:
    """This process's environment for a child job: ``paths`` (the checkout, say) first on
    ``PYTHONPATH``, one OpenMP thread unless set, and ``extra`` on top.  Variables whose
    names start with one of ``drop`` (``("AIAK_", "HOROVOD_")``, say) are left out, so that
    no switch of this shell changes what the job measures."""
    env = {k: v for k, v in os.environ.items() if not (drop and k.startswith(tuple(drop)))}
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(list(paths) + [env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


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
