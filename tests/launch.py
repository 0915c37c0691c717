"""Launching per-rank test programs from pytest."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Per-rank programs that tests and benchmarks both run (and the modules they share).
JOBS = os.path.join(REPO, "benchmarks", "jobs")


def mpiexec() -> str:
    candidates = [os.path.join(sysconfig.get_path("scripts"), "mpiexec"), shutil.which("mpiexec")]
    for c in candidates:
        if c and os.path.exists(c):
            return c
    raise RuntimeError("mpiexec not found: install an MPI (pip install mpich)")


def env_with(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests", "parallel"),
                                         env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    # A test that desynchronises ranks must fail, not hang until the outer timeout.  The
    # deadlock check stays on beside the stall shutdown, so that the whole suite shows it
    # never ends a job that would have gone on.
    env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", "20")
    env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "90")
    env.setdefault("AIAK_DEADLOCK_SHUTDOWN", "1")
    env.update(extra or {})
    return env


def clean_env(**extra: str) -> Dict[str, str]:
    """This process's environment without AIAK_*/HOROVOD_* switches (so none leaks into a job a
    test launches), with the checkout on PYTHONPATH and ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIAK_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def mpi_command(nodes: Sequence[int], argv: List[str], virtual_hosts: bool) -> List[str]:
    """mpiexec argv for ranks laid out as ``nodes`` (ranks per node).

    With virtual hosts, each node's ranks get HOROVOD_HOSTNAME=nodeK through MPMD sections.
    """
    cmd = [mpiexec()]
    if not virtual_hosts:
        return cmd + ["-n", str(sum(nodes))] + argv
    for k, n in enumerate(nodes):
        if k:
            cmd.append(":")
        cmd += ["-n", str(n), "-env", "HOROVOD_HOSTNAME", f"node{k}"] + argv
    return cmd


def run_ranks(nodes: Sequence[int], argv: List[str], env: Optional[Dict[str, str]] = None,
              virtual_hosts: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = mpi_command(nodes, argv, virtual_hosts) if sum(nodes) > 1 or virtual_hosts else argv
    return subprocess.run(cmd, env=env_with(env), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


# One pytest summary per rank: "12 passed in 3.4s", "12 passed, 2 skipped, 1 warning in ...".
# Ranks share stdout, so two summaries can land on one line; hence no "^" anchor.
_SUMMARY = re.compile(r"(\d+) passed(?:, \d+ (?:skipped|deselected|warnings?))* in ")


def check_rank_summaries(stdout: str, nranks: int, minimum: int) -> int:
    """Assert that every rank's pytest session passed the same number of tests, at least
    ``minimum`` (so a per-rank file that skipped most of its tests fails), and none failed;
    return that number."""
    summaries = _SUMMARY.findall(stdout)
    assert len(summaries) == nranks, stdout[-4000:]
    assert len(set(summaries)) == 1, summaries  # every rank ran the same tests
    assert not re.search(r"\d+ failed", stdout), stdout[-4000:]
    passed = int(summaries[0])
    assert passed >= minimum, f"each rank passed {passed} tests, fewer than {minimum}"
    return passed


def aiakrun_digits_result(epochs: int) -> Tuple[int, int]:
    """(correct, total) test samples of examples/pytorch_digits.py trained by ``aiakrun -np 2``
    for ``epochs``: the reference that other launchers (Ray, Spark) must reproduce."""
    proc = subprocess.run(["aiakrun", "-np", "2", sys.executable,
                           os.path.join(REPO, "examples", "pytorch_digits.py"),
                           "--epochs", str(epochs)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"test accuracy: [\d.]+% \((\d+)/(\d+)\)", proc.stdout)
    assert found, proc.stdout
    correct, total = map(int, found.groups())
    return correct, total


def processes_with(marker: str) -> List[int]:
    """PIDs of live processes whose command line contains ``marker`` (zombies have none, so
    they never match): what a test's job left behind."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def require_emulation() -> None:
    """Skip (with the reason) where an emulated cluster cannot be built: not root, not Linux,
    or what ``can_emulate()`` reports."""
    import pytest
    from aiak_training.testing.cluster import can_emulate
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the emulated cluster needs root on Linux (network namespaces, veth, tc)")
    ok, why = can_emulate()
    if not ok:
        pytest.skip(f"cannot emulate a cluster here: {why}")


def netns_pids(ns: str) -> List[int]:
    """PIDs of the processes in network namespace ``ns``."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                         timeout=10).stdout
    return [int(p) for p in out.split() if p.isdigit()]
