"""Running ``aiakrun`` elastic jobs from tests: start, watch progress, change hosts, kill."""
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from launch import REPO, env_with

SCRIPT = os.path.join(REPO, "tests", "scripts", "elastic_exact.py")


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
            os.killpg(self.proc.pid, signal.SIGKILL)
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


def kill_host(host: str) -> List[int]:
    """SIGKILL every process of ``host``'s workers at once (the node dies)."""
    pids = worker_pids(host)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


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
