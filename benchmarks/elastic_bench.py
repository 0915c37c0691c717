"""Elastic training on the emulated 3x1 cluster at 1 Gbit/s: how fast a job recovers from a
lost node and grows to a new one (needs root: network namespaces).

Each repetition is one elastic job (``aiakrun --host-discovery-script``, default settings,
benchmarks/jobs/elastic_exact.py as the training program) run from node 0:

* it starts on nodes 0-1; the discovery script then lists node 2: ``grow_s`` is the time from
  that change to the first step completed with 3 ranks;
* a few steps later node 2 is SIGKILLed as a whole: ``recovery_s`` is the time from the kill
  to the first step completed by the survivors;
* ``committed_steps_lost``: committed steps missing from the final state (must be 0); the
  exact replay of the committed steps must give the final parameters.

Figures (JSON ``figures``): the medians of recovery_s and grow_s, the worst steps lost.
Ratios: ``recovery_target_over_measured`` = 10 s / recovery_s and
``grow_target_over_measured`` = 15 s / grow_s (above 1: the target is met).

    python benchmarks/elastic_bench.py --reps 3 \\
        --json benchmarks/results/elastic_3x1_1gbit_<date>.json
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
JOBS = os.path.join(HERE, "jobs")
sys.path[:0] = [HERE, JOBS]

import elastic_exact  # noqa: E402
from bench_common import machine_info, read_json  # noqa: E402

SCRIPT = os.path.join(JOBS, "elastic_exact.py")


def _netns_pids(ns):
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                         timeout=10).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _steps(path):
    try:
        with open(path) as f:
            return [(float(w[0]), int(w[1]), int(w[2])) for w in
                    (line.split() for line in f if line.strip())]
    except (OSError, ValueError):
        return []


def _wait(cond, timeout, what, log):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}; log tail:\n{open(log).read()[-3000:]}")


def one_run(cluster, work):
    hosts = cluster.hosts
    host_file = os.path.join(work, "hosts")
    _write(host_file, f"{hosts[0]}:1\n{hosts[1]}:1\n")
    script = os.path.join(work, "discover.sh")
    _write(script, f"#!/bin/sh\ncat {host_file}\n")
    os.chmod(script, 0o755)
    steps_log, progress = os.path.join(work, "steps"), os.path.join(work, "progress")
    out, log = os.path.join(work, "out.json"), os.path.join(work, "job.log")
    for p in (steps_log, progress, out):
        if os.path.exists(p):
            os.remove(p)
    env = {"STEP_SLEEP": "0.1", "COMMIT_EVERY": "2", "EPOCHS": "12", "OUT": out,
           "PROGRESS": progress, "STEPS_LOG": steps_log, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "aiak_training.runner.launch", "-np", "2", "--min-np", "2",
           "--host-discovery-script", script, sys.executable, SCRIPT]
    result = {}
    with open(log, "w") as logf:
        def run():
            result["proc"] = cluster.run(cmd, env=env, timeout=400, stdout=logf,
                                         stderr=subprocess.STDOUT)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        _wait(lambda: len(_steps(steps_log)) >= 4, 180, "the first steps", log)
        listed = time.time()
        _write(host_file, f"{hosts[0]}:1\n{hosts[1]}:1\n{hosts[2]}:1\n")
        _wait(lambda: any(s == 3 for _, s, _ in _steps(steps_log)), 120, "growth", log)
        _wait(lambda: sum(1 for _, s, _ in _steps(steps_log) if s == 3) >= 6, 60,
              "steps on 3 ranks", log)
        with open(progress) as f:
            committed_at_kill = int(f.read().split()[0])
        killed = time.time()
        for pid in _netns_pids(cluster.namespaces[2]):
            os.kill(pid, signal.SIGKILL)
        thread.join(400)
    proc = result.get("proc")
    if proc is None or proc.returncode != 0:
        raise RuntimeError(f"job failed; log tail:\n{open(log).read()[-3000:]}")
    steps = _steps(steps_log)
    grow = min(t for t, s, _ in steps if s == 3) - listed
    recovery = min(t for t, s, _ in steps if s == 2 and t > killed) - killed
    final = read_json(out)
    history = [(e, size, [list(p) for p in parts]) for e, size, parts in final["history"]]
    sizes = [h[1] for h in history]
    first3 = sizes.index(3)
    after = sizes.index(2, first3)  # the first committed step after the loss of node 2
    lost = max(0, committed_at_kill - after)
    exact = elastic_exact.replay(history) == final["params"]
    return {"grow_s": grow, "recovery_s": recovery, "committed_steps_lost": lost,
            "uncommitted_steps_redone": max(0, max(n for t, s, n in steps if t < killed)
                                            - after),
            "exact": exact}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    from aiak_training.testing.cluster import EmulatedCluster
    runs = []
    with EmulatedCluster(3, 1, args.rate, verify="warn", log=None) as cluster:
        for rep in range(args.reps):
            with tempfile.TemporaryDirectory(prefix="elastic_bench.") as work:
                r = one_run(cluster, work)
            print(f"rep {rep}: grow {r['grow_s']:.2f} s, recovery {r['recovery_s']:.2f} s, "
                  f"committed steps lost {r['committed_steps_lost']}, "
                  f"redone {r['uncommitted_steps_redone']}, exact {r['exact']}", flush=True)
            runs.append(r)
        link = cluster.measured_gbit or cluster.rate_gbit
    recovery = statistics.median(r["recovery_s"] for r in runs)
    grow = statistics.median(r["grow_s"] for r in runs)
    figures = {"recovery_s": recovery, "grow_s": grow,
               "committed_steps_lost": max(r["committed_steps_lost"] for r in runs),
               "all_exact": all(r["exact"] for r in runs)}
    ratios = {"recovery_target_over_measured": 10.0 / recovery,
              "grow_target_over_measured": 15.0 / grow}
    machine = machine_info(ranks=3, layout="3x1", link_gbit=link)
    print("# elastic_bench (emulated 3x1, " + args.rate + ")")
    print("# machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    for k, v in figures.items():
        print(f"  {k} = {v}")
    for k, v in ratios.items():
        print(f"  {k} = {v:.3f}")
    if args.json:
        results = [{"name": name, "params": {"reps": len(runs)},
                    "median_s": statistics.median(r[name] for r in runs),
                    "min_s": min(r[name] for r in runs), "max_s": max(r[name] for r in runs),
                    "reps": len(runs)} for name in ("recovery_s", "grow_s")]
        with open(args.json, "w") as f:
            json.dump({"benchmark": "elastic_bench", "machine": machine, "results": results,
                       "figures": figures, "ratios": ratios, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
