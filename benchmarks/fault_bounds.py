"""How long a job takes to end after a network fault, on the emulated 2 x 2 cluster.

Needs root (it builds the cluster itself).  For each scenario and run it starts
``aiakrun -np 4`` with benchmarks/jobs/fault_stream.py inside a fresh
``aiak_training.testing.cluster`` (2 nodes x 2 ranks, 1 Gbit/s), injects the fault once every
rank streams allreduces, and records when each rank's process was gone and when aiakrun
returned, in seconds after the fault, plus aiakrun's exit status and report:

* ``link_down``: node 1's link taken down (``EmulatedCluster.link_down(1)``);
* ``node_kill``: every process of the job on node 1 SIGKILLed;
* ``rank_kill``: only the two rank processes on node 1 SIGKILLed;
* ``stall``: rank 3 never calls a collective (``HOROVOD_STALL_CHECK_TIME_SECONDS=2``,
  ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5``); times count from when every rank started;
* ``slow``: no fault, 5% packet loss and 64 MiB allreduces, which must complete (the
  watchdog must not take a slow collective for a hang).
* ``stuck``: rank 1 sleeps 45 s after ``hvd.init()`` while the others allreduce and exit on
  the ``HorovodInternalError`` of the stall shutdown (``--stall-check-warning-time-seconds 2
  --stall-check-shutdown-time-seconds 5``); times count from when every rank started;
* ``stuck_1node``: as ``stuck``, with all four ranks on node 0 (``-H <node 0>:4``).  Across
  nodes, a waiting rank on the other node leaves ``MPI_Finalize`` quickly and its exit ends
  the job; on one node every waiting rank would sit in ``MPI_Finalize`` until the stuck rank
  wakes, unless ``AIAK_EXIT_TIMEOUT_SECONDS`` bounds it (run with it set to 0 to see that);
* ``stuck_local``: as ``stuck``, with ``aiakrun -np 4`` on this machine outside the cluster
  (MPICH's default transport), where a rank's ``MPI_Finalize`` waits for the stuck one;
* ``launcher_kill``: ``aiakrun`` itself SIGKILLed while every rank trains.
For these two the record holds ``last_process_gone_s``: when no process of the job was left
in either node's namespace (target: under 15 s).

The collective watchdog runs with its default timeout unless ``--timeout-s`` is given.

    sudo python benchmarks/fault_bounds.py --runs 3 --out faults.json
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from aiak_training.testing.cluster import EmulatedCluster, leftovers  # noqa: E402

STREAM = os.path.join(HERE, "jobs", "fault_stream.py")
LAUNCHER_FAULTS = os.path.join(HERE, "jobs", "launcher_faults.py")
AIAKRUN = [sys.executable, "-m", "aiak_training.runner.launch", "-np", "4"]


def _pids(ns: str) -> List[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                         timeout=10).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def one_run(scenario: str, env: Dict[str, str], limit_s: float) -> Dict:
    with tempfile.TemporaryDirectory(prefix="aiak_faults_") as out, \
            EmulatedCluster(2, 2, "1gbit", verify="off", log=None) as cluster:
        args = [sys.executable, STREAM, "stream", out]
        if scenario == "stall":
            args = [sys.executable, STREAM, "stall", out]
            env = dict(env, HOROVOD_STALL_CHECK_TIME_SECONDS="2",
                       HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="5")
        if scenario == "slow":
            cluster.impair(loss_pct=5)
            args = [sys.executable, STREAM, "big", out, "64", "2"]
        result: Dict = {}

        def run() -> None:
            result["proc"] = cluster.run(AIAKRUN + args, env=env, timeout=limit_s,
                                         reap=False, capture_output=True, text=True)
            result["ended"] = time.monotonic()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while thread.is_alive() and not all(
                os.path.exists(os.path.join(out, f"ready.{r}")) for r in range(4)):
            time.sleep(0.1)
        pids = {}
        for r in range(4):
            with open(os.path.join(out, f"pid.{r}")) as f:
                pids[r] = int(f.read().split()[0])
        fault = time.monotonic()
        if scenario == "link_down":
            cluster.link_down(1)
        elif scenario == "node_kill":
            for pid in _pids(cluster.namespaces[1]):
                os.kill(pid, signal.SIGKILL)
        elif scenario == "rank_kill":
            for r in (2, 3):
                os.kill(pids[r], signal.SIGKILL)
        exits: Dict[int, float] = {}
        while len(exits) < 4 and time.monotonic() - fault < limit_s:
            for r, pid in pids.items():
                if r not in exits and _gone(pid):
                    exits[r] = round(time.monotonic() - fault, 2)
            time.sleep(0.05)
        thread.join(timeout=limit_s + 30)
        proc = result["proc"]
        output = proc.stdout + proc.stderr
        time.sleep(1.0)
        left = [p for ns in cluster.namespaces for p in _pids(ns)]
        prefix = cluster.prefix
    return {
        "scenario": scenario,
        "rank_exit_s": exits,
        "aiakrun_exit_s": round(result["ended"] - fault, 2),
        "aiakrun_status": proc.returncode,
        "report": [ln for ln in output.splitlines() if ln.startswith("aiakrun: job failed")],
        "big_ops_s": [float(x) for x in re.findall(r"BIG op \d+: ([\d.]+) s", output)],
        "watchdog_fired": "collective watchdog" in output,
        "processes_left": left,
        "cluster_left": leftovers(prefix) if prefix else [],
    }


def _alive_in(namespaces: List[str]) -> List[int]:
    return [p for ns in namespaces for p in _pids(ns) if not _gone(p)]


def launcher_run(scenario: str, env: Dict[str, str], limit_s: float) -> Dict:
    """``stuck``, ``stuck_1node`` or ``launcher_kill`` (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="aiak_faults_") as out, \
            EmulatedCluster(2, 2, "1gbit", verify="off", log=None) as cluster:
        stuck = scenario.startswith("stuck")
        flags = (["--stall-check-warning-time-seconds", "2",
                  "--stall-check-shutdown-time-seconds", "5"] if stuck else [])
        if scenario == "stuck_1node":
            flags += ["-H", f"{cluster.hosts[0]}:4"]
        mode = "stuck" if stuck else "train"
        result: Dict = {}

        def run() -> None:
            result["proc"] = cluster.run(AIAKRUN + flags + [sys.executable, LAUNCHER_FAULTS,
                                                            mode, out],
                                         env=env, timeout=limit_s, reap=False,
                                         capture_output=True, text=True)
            result["ended"] = time.monotonic()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while thread.is_alive() and not all(
                os.path.exists(os.path.join(out, f"ready.{r}")) for r in range(4)):
            time.sleep(0.05)
        start = time.monotonic()
        if scenario == "launcher_kill":
            time.sleep(1.0)  # a few training steps
            (aiakrun,) = [p for p in _pids(cluster.namespaces[0]) if b"runner.launch" in
                          open(f"/proc/{p}/cmdline", "rb").read()]
            start = time.monotonic()
            os.kill(aiakrun, signal.SIGKILL)
        gone = None
        while time.monotonic() - start < limit_s:
            if not _alive_in(cluster.namespaces):
                gone = round(time.monotonic() - start, 2)
                break
            time.sleep(0.05)
        thread.join(timeout=limit_s + 30)
        proc = result.get("proc")
        output = (proc.stdout + proc.stderr) if proc is not None else ""
        prefix = cluster.prefix
        left = _alive_in(cluster.namespaces)
    return {
        "scenario": scenario,
        "last_process_gone_s": gone,
        "aiakrun_exit_s": round(result["ended"] - start, 2) if "ended" in result else None,
        "aiakrun_status": proc.returncode if proc is not None else None,
        "report": [ln for ln in output.splitlines() if ln.startswith("aiakrun: ")],
        "banner_shown": "BAD TERMINATION" in output,
        "processes_left": left,
        "cluster_left": leftovers(prefix) if prefix else [],
    }


def local_stuck_run(env: Dict[str, str], limit_s: float) -> Dict:
    """``stuck_local``: the stuck-rank job on this machine, no cluster."""
    import uuid
    marker = f"aiak_bench_{uuid.uuid4().hex}"

    def job_pids() -> List[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read() and not _gone(int(pid)):
                        found.append(int(pid))
            except OSError:
                pass
        return found

    with tempfile.TemporaryDirectory(prefix="aiak_faults_") as out:
        proc = subprocess.Popen(AIAKRUN + ["--stall-check-warning-time-seconds", "2",
                                           "--stall-check-shutdown-time-seconds", "5",
                                           sys.executable, LAUNCHER_FAULTS, "stuck", out,
                                           marker],
                                env=dict(os.environ, **env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None and not all(
                os.path.exists(os.path.join(out, f"ready.{r}")) for r in range(4)):
            time.sleep(0.05)
        start = time.monotonic()
        ended = gone = None
        while time.monotonic() - start < limit_s:
            if ended is None and proc.poll() is not None:
                ended = round(time.monotonic() - start, 2)
            if ended is not None and not job_pids():
                gone = round(time.monotonic() - start, 2)
                break
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    return {"scenario": "stuck_local", "last_process_gone_s": gone, "aiakrun_exit_s": ended,
            "aiakrun_status": proc.returncode,
            "report": [ln for ln in output.splitlines() if ln.startswith("aiakrun: ")],
            "finalize_bounded": "MPI_Finalize did not return" in output,
            "banner_shown": "BAD TERMINATION" in output, "processes_left": job_pids()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--scenarios", default="link_down,node_kill,slow")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="AIAK_COLLECTIVE_TIMEOUT_SECONDS for the ranks (default: unset)")
    p.add_argument("--out", default=None, help="write the runs as JSON here")
    args = p.parse_args()
    env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    if args.timeout_s is not None:
        env["AIAK_COLLECTIVE_TIMEOUT_SECONDS"] = f"{args.timeout_s:g}"
    runs = []
    for scenario in args.scenarios.split(","):
        for i in range(args.runs):
            if scenario == "stuck_local":
                record = local_stuck_run(env, limit_s=120)
            elif scenario in ("stuck", "stuck_1node", "launcher_kill"):
                record = launcher_run(scenario, env, limit_s=120)
            else:
                record = one_run(scenario, env, limit_s=300)
            record["run"] = i + 1
            runs.append(record)
            print(json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "timeout_s": args.timeout_s,
                       "exit_timeout_s": os.environ.get("AIAK_EXIT_TIMEOUT_SECONDS"),
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
