"""How fast a certain deadlock ends, and what the wait costs the cores (issue 40).

Runs the mistake the issue found under ``aiakrun -np 2`` (benchmarks/jobs/deadlock.py
``helper``: a sharded optimizer's ``consolidate_state_dict()`` called on rank 0 only) with
the stall-warning time T of each ``--warn-seconds`` value, ``--runs`` times each.  Every
rank records how long it waited before the deadlock error and the CPU its process used
meanwhile (all threads: the engine's, MPI's progress and the waiting thread).

Ratios (above 1 is better, 1 is the target):

* ``deadlock_end_vs_bound_T<T>``: 2 T over the longest wait of any rank in any run (the
  issue: the job ends within twice the warning time);
* ``wait_cpu_vs_budget_T<T>``: 5% of a core over the highest CPU share of any rank's wait.

    python benchmarks/deadlock_bench.py --warn-seconds 5 60 --runs 3 --json out.json
"""
import argparse
import os
import sys
import tempfile
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import child_env, machine_info, read_json, report, run_jobs  # noqa: E402

REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "jobs", "deadlock.py")
CPU_BUDGET = 0.05  # of one core, while waiting


def one_run(warn_s: float) -> List[Dict]:
    """The per-rank records of one deadlocked job (which ends with aiakrun's status 1)."""
    with tempfile.TemporaryDirectory() as out:
        env = child_env(REPO, drop=("AIAK_", "HOROVOD_"), OMP_NUM_THREADS="1",
                        HOROVOD_STALL_CHECK_TIME_SECONDS=str(warn_s))
        waited = [os.path.join(out, f"waited.{rank}.json") for rank in (0, 1)]
        run_jobs([[sys.executable, "-m", "aiak_training.runner.launch", "-np", "2",
                   sys.executable, SCRIPT, "helper", out]], f"the deadlock job (T={warn_s:g} s)",
                 timeout=4 * warn_s + 300, env=env, cwd=REPO, expect=1, writes=waited)
        records = [read_json(path) for path in waited]
        if any(r["error"] != "DeadlockError" for r in records):
            raise SystemExit(f"not a deadlock error: {records}")
        return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warn-seconds", type=float, nargs="+", default=[5.0, 60.0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results, ratios = [], {}
    for warn_s in args.warn_seconds:
        records = [r for _ in range(args.runs) for r in one_run(warn_s)]
        waits = [r["waited_s"] for r in records]
        shares = [r["cpu_s"] / r["waited_s"] for r in records]
        tag = f"T{warn_s:g}"
        results.append({"name": f"wait_until_error_{tag}", "params": {"warn_s": warn_s},
                        "median_s": sorted(waits)[len(waits) // 2], "min_s": min(waits),
                        "max_s": max(waits), "reps": len(waits),
                        "cpu_share_of_a_core": {"min": min(shares), "max": max(shares)}})
        ratios[f"deadlock_end_vs_bound_{tag}"] = 2 * warn_s / max(waits)
        ratios[f"wait_cpu_vs_budget_{tag}"] = CPU_BUDGET / max(max(shares), 1e-9)
        print(f"T={warn_s:g} s: ranks {[r['rank'] for r in records]}; waits {', '.join(f'{w:.2f}' for w in waits)} s; CPU share "
              f"{', '.join(f'{s:.4f}' for s in shares)}", flush=True)
    report("deadlock_bench", machine_info(ranks=2), results, ratios, args.json)


if __name__ == "__main__":
    main()
