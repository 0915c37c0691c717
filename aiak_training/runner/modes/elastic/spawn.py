"""Starting one elastic worker process on a host, and passing its output on.

Local hosts (and ``--virtual-hosts``) run the worker directly; other hosts go through
``ssh`` or, in the emulated cluster, its launch agent (``AIAK_CLUSTER_LAUNCHER_EXEC``),
which takes ssh's arguments.  The worker runs behind :mod:`aiak_training.runner.guard.task_wrapper`
as in MPI mode, and each output line is prefixed with the worker's host and slot.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Sequence, TextIO

from aiak_training.runner.cli.hosts import is_local_host


def worker_argv(wrapped: Sequence[str], host: str, rank_env: Dict[str, str],
                env: Dict[str, str], local: bool, remote_exec: Sequence[str]) -> List[str]:
    """What to execute on this machine to start ``wrapped`` (the command behind the task
    wrapper) on ``host``; ``rank_env`` is the worker's own environment on top of ``env``.
    Remote hosts get the same shell line as in ``aiakrun --gloo`` (one implementation)."""
    from aiak_training.runner.modes.gloo_run import remote_command
    if local:
        return list(wrapped)
    return list(remote_exec) + [host, remote_command(rank_env, env, os.getcwd(), wrapped)]


def _pump(stream, label: str, out: TextIO) -> None:
    try:
        for raw in iter(stream.readline, b""):
            out.write(f"[{label}]: " + raw.decode("utf-8", "replace").rstrip("\n") + "\n")
            out.flush()
    except (OSError, ValueError):
        pass
    finally:
        stream.close()


class WorkerProcess:
    """One running worker: its process, and the threads passing its output on."""

    def __init__(self, label: str, argv: Sequence[str], env: Dict[str, str],
                 stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr):
        self.label = label
        # A session of its own: the driver stops a worker (and its launch agent or ssh)
        # as one process group, and a terminal's Ctrl-C reaches only the driver.
        self.proc = subprocess.Popen(list(argv), env=env, start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self._threads = [threading.Thread(target=_pump, args=(s, label, o), daemon=True)
                         for s, o in ((self.proc.stdout, stdout), (self.proc.stderr, stderr))]
        for t in self._threads:
            t.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float) -> Optional[int]:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        for t in self._threads:
            t.join(timeout=1.0)
        return code


def host_is_local(host: str, virtual: bool) -> bool:
    return virtual or is_local_host(host)
