"""How long ``pip install -e '.[extra]'`` takes: a first install, and a second one with
another extra and unchanged sources, which setup.py's build cache should make cheap.

    python benchmarks/install_bench.py --json benchmarks/results/install_reuse_<date>.json

Works on a copy of the checkout (tracked and untracked, non-ignored files: no build outputs)
in a temporary directory, installed into a temporary virtualenv that sees this Python's
packages (``--system-site-packages``), so the dependencies are already there and only the
build is timed; the checkout and its environment are left alone.  Rounds: a cold install
(the build cache emptied), then ``--reps-per-cold`` installs with other extras, repeated
``--cold-reps`` times.  pip's build isolation is on, as for a user.

Figures:

* ``second_install_s``: median wall time of an install after the first (target <= 30 s).
* ``cold_vs_second_install`` (ratio): median cold install / median second install.

CPU seconds (of pip and all it ran) are reported next to the wall times: on a machine shared
with other work the wall time follows the load average (also recorded), the CPU time far less.
"""
import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, report, summarize  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRAS = ["test", "examples", "docs", "ray", "spark", "tensorflow"]


def copy_checkout(dest: str) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in files)):
        src = os.path.join(REPO, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pip_install(python: str, tree: str, extra: str, cpu: List[float]) -> float:
    """Wall seconds of one install; its CPU seconds (pip and everything it ran) go to ``cpu``:
    on a shared machine the wall time follows the load, the CPU time much less."""
    start, cpu_start = time.perf_counter(), _children_cpu()
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "-e", f".[{extra}]"],
                          cwd=tree, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    cpu.append(_children_cpu() - cpu_start)
    if proc.returncode != 0:
        raise SystemExit(f"pip install -e '.[{extra}]' failed:\n{proc.stdout}\n{proc.stderr}")
    return elapsed


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold-reps", type=int, default=2,
                        help="cold installs (each compiles everything; minutes)")
    parser.add_argument("--reps-per-cold", type=int, default=3,
                        help="installs with another extra after each cold one")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    cold: List[float] = []
    second: List[float] = []
    cold_cpu: List[float] = []
    second_cpu: List[float] = []
    with tempfile.TemporaryDirectory(prefix="aiak-install-bench-") as tmp:
        tree, venv = os.path.join(tmp, "src"), os.path.join(tmp, "venv")
        copy_checkout(tree)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv],
                       check=True)
        python = os.path.join(venv, "bin", "python")
        env_cache = os.path.join(tree, "build", "aiak-ext-cache")
        turn = 0
        for _ in range(args.cold_reps):
            shutil.rmtree(env_cache, ignore_errors=True)
            cold.append(pip_install(python, tree, EXTRAS[turn % len(EXTRAS)], cold_cpu))
            print(f"cold install: {cold[-1]:.1f} s (CPU {cold_cpu[-1]:.1f} s)", flush=True)
            for _ in range(args.reps_per_cold):
                turn += 1
                extra = EXTRAS[turn % len(EXTRAS)]
                second.append(pip_install(python, tree, extra, second_cpu))
                print(f"second install (.[{extra}]): {second[-1]:.1f} s "
                      f"(CPU {second_cpu[-1]:.1f} s)", flush=True)
    machine = machine_info()
    machine["load_average"] = os.getloadavg()
    results = [summarize("cold install (cache emptied)", {"extras": "rotating"}, cold),
               summarize("second install, another extra", {"extras": "rotating"}, second),
               summarize("cold install, CPU seconds", {"extras": "rotating"}, cold_cpu),
               summarize("second install, CPU seconds", {"extras": "rotating"}, second_cpu)]
    ratios = {"cold_vs_second_install": statistics.median(cold) / statistics.median(second),
              "second_install_s": statistics.median(second)}
    report("install_reuse", machine, results, ratios, args.json)


if __name__ == "__main__":
    main()
