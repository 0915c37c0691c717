"""Running ``aiakrun`` elastic jobs from tests: start, watch progress, change hosts, kill;
locally or on the emulated cluster (network namespaces, root only)."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from launch import JOBS, REPO, env_with, netns_pids, require_emulation

SCRIPT = os.path.join(JOBS, "elastic_exact.py")
sys.path.insert(0, JOBS)
import elastic_exact  # noqa: E402  (its exact replay)


def write_hosts(path: str, hosts: Sequence[str]) -> None:
    with open(path + ".tmp", "w") as f:
        f.write("".join(f"{h}\n" for h in hosts))
    os.replace(path + ".tmp", path)


def discovery_script(tmp_path, hosts: Sequence[str]) -> (str, str):
    """An executable that prints the host file; returns (script, host file)."""
    host_file = str(tmp_path / "hosts")
    write_hosts(host_file, hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {host_file}\n")
    script.chmod(0o755)
    return str(script), host_file


class ElasticJob:
    """``aiakrun`` started in the background; its output goes to a file."""

    def __init__(self, argv: List[str], tmp_path, env: Optional[Dict[str, str]] = None,
                 runner: Optional[Callable[[List[str], Dict[str, str], object], subprocess.Popen]]
                 = None):
        self.log_path = str(tmp_path / "job.log")
        self.progress = str(tmp_path / "progress")
        self.out = str(tmp_path / "out.json")
        full_env = env_with({"OUT": self.out, "PROGRESS": self.progress,
                             "HOROVOD_GLOO_TIMEOUT_SECONDS": "20", **(env or {})})
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "aiak_training.runner.launch", *argv]
        if runner is None:
            self.proc = subprocess.Popen(cmd, env=full_env, cwd=REPO, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        else:
            self.proc = runner(cmd, full_env, self._log)

    def steps(self) -> (int, int):
        """(committed steps, world size) as rank 0 last wrote them; (0, 0) before."""
        try:
            with open(self.progress) as f:
                words = f.read().split()
            return int(words[0]), int(words[-1])
        except (OSError, ValueError):
            return 0, 0

    def wait_steps(self, count: int, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.steps()[0] >= count:
                return self.steps()[0]
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended early:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {count} committed steps in {timeout} s:\n{self.log()[-4000:]}")

    def wait_log(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not in the log:\n{self.log()[-4000:]}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def finish(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if isinstance(self.proc, subprocess.Popen):
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"job did not end in {timeout} s:\n{self.log()[-4000:]}")
        finally:
            self._log.close()


def worker_pids(host: str) -> List[int]:
    """Local processes of the elastic worker on (virtual) ``host``: wrapper and program."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"HOROVOD_HOSTNAME={host}".encode() in env and \
                any(e.startswith(b"AIAK_ELASTIC_WORKER_ID=") for e in env):
            found.append(int(pid))
    return found


def _kill_all(pids: List[int]) -> List[int]:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def kill_host(host: str) -> List[int]:
    """SIGKILL every process of ``host``'s workers at once (the node dies)."""
    return _kill_all(worker_pids(host))


def check_epochs(history, n_samples: int, epochs: int) -> None:
    """Every epoch processed every sample: none skipped, and repeats only where a pass over
    the remaining samples was padded to a multiple of the world size."""
    for epoch in range(epochs):
        steps = [h for h in history if h[0] == epoch]
        seen = [i for h in steps for part in h[2] for i in part]
        assert sorted(set(seen)) == list(range(n_samples)), (epoch, sorted(set(seen)))
        # Padding adds fewer than `size` repeats per pass; passes change with the size.
        passes = 1 + sum(1 for a, b in zip(steps, steps[1:]) if a[1] != b[1])
        assert len(seen) - n_samples < passes * max(h[1] for h in steps), (epoch, len(seen))


def check_exact(history, params, epochs: int) -> None:
    """tests/scripts/elastic_exact.py's run: every epoch saw every sample, and the final
    parameters equal a single-process replay of the committed steps."""
    check_epochs(history, elastic_exact.N_SAMPLES, epochs)
    assert elastic_exact.replay(history) == params


def exact_result(job: "ElasticJob"):
    """(output, history) that tests/scripts/elastic_exact.py wrote."""
    with open(job.out) as f:
        out = json.load(f)
    history = [(e, size, [list(p) for p in parts]) for e, size, parts in out["history"]]
    return out, history


def accuracy(text: str) -> float:
    """The last "test accuracy: N%" a digits example printed."""
    found = re.findall(r"test accuracy: ([\d.]+)%", text)
    assert found, text[-4000:]
    return float(found[-1])


# ---- the emulated cluster ---------------------------------------------------------------------
@contextlib.contextmanager
def emulated_cluster(nodes: int, ranks_per_node: int = 1) -> Iterator[object]:
    """An EmulatedCluster of ``nodes`` x ``ranks_per_node`` at 1 Gbit/s (skips where none can
    be built).  On a clean exit, every process of the jobs must have ended by itself (jobs
    run with ``reap=False``) and the teardown must leave nothing behind."""
    require_emulation()
    from aiak_training.testing import cluster as cl
    with cl.EmulatedCluster(nodes, ranks_per_node, "1gbit", verify="off", log=None) as cluster:
        yield cluster
        deadline = time.monotonic() + 10
        while [p for ns in cluster.namespaces for p in netns_pids(ns)] and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        left = {ns: netns_pids(ns) for ns in cluster.namespaces}
        assert not any(left.values()), f"processes left in the namespaces: {left}"
        prefix = cluster.prefix
    assert cl.leftovers(prefix) == []


def cluster_run(cluster, cmd: List[str], env: Optional[Dict[str, str]] = None,
                timeout: float = 400, **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` on the cluster's node 0 (the head node), in the repository, with the tests'
    environment; processes it leaves behind are not reaped (emulated_cluster checks)."""
    full = {k: v for k, v in env_with(env).items() if k not in cluster.env}
    return cluster.run(cmd, env=full, timeout=timeout, reap=False, cwd=REPO, **kwargs)


class _ClusterProcess:
    """``cluster_run`` in a thread, looking like a Popen to ElasticJob."""

    def __init__(self, cluster, cmd, env, log):
        self.returncode = None
        self._cluster = cluster

        def run() -> None:
            try:
                done = cluster_run(cluster, cmd, env, stdout=log, stderr=subprocess.STDOUT)
                self.returncode = done.returncode
            except subprocess.TimeoutExpired:
                self.returncode = -signal.SIGKILL
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("aiakrun", timeout)
        return self.returncode

    def kill(self) -> None:
        """The whole job, on every node."""
        for node in range(self._cluster.nodes):
            kill_node(self._cluster, node)


def cluster_job(cluster, argv: List[str], tmp_path,
                env: Optional[Dict[str, str]] = None) -> "ElasticJob":
    """``aiakrun argv`` started on the cluster's head node (node 0)."""
    return ElasticJob(argv, tmp_path, env,
                      runner=lambda cmd, full_env, log: _ClusterProcess(cluster, cmd, full_env,
                                                                        log))


def kill_node(cluster, node: int) -> List[int]:
    """SIGKILL every process in ``node``'s namespace at once (the node dies)."""
    return _kill_all(netns_pids(cluster.namespaces[node]))
