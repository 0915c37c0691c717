"""Run the MPI launcher as a child, forward signals, and make sure a failed job ends entirely.

The launcher runs in its own session so that a terminal's Ctrl-C reaches aiakrun only and is
forwarded once (rather than hitting every process at the same time).  aiakrun registers as
child subreaper: processes orphaned when the launcher dies are re-parented to it, so the
final sweep finds them even though hydra starts every rank in a session of its own.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence, TextIO

from aiak_training.runner import proc_tree
from aiak_training.runner.failure import (RankFailure, describe_returncode, has_failures,
                                          read_failures, shell_status)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Timeouts:
    """How long each stage of a teardown may take, in seconds."""

    # After a rank failed: time for the launcher to abort the job by itself.
    failure_grace: float = 5.0
    # After a stop signal was forwarded: time for ranks to exit cleanly (checkpoint, etc.).
    signal_grace: float = 10.0
    # After SIGTERM to the launcher: time before everything left is SIGKILLed.
    terminate_grace: float = 3.0
    poll: float = 0.1


@dataclass
class JobResult:
    """How the job ended."""

    exit_code: int
    launcher_returncode: int
    failures: List[RankFailure] = field(default_factory=list)
    stop_signal: Optional[int] = None


class _Supervisor:
    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], failure_dir: str,
                 timeouts: Timeouts):
        self.cmd, self.env, self.failure_dir, self.t = list(cmd), dict(env), failure_dir, timeouts
        self.pending: List[int] = []
        self.stop_signal: Optional[int] = None
        self.preexisting = set(proc_tree.children(os.getpid()))

    def _on_signal(self, signum: int, _frame) -> None:
        self.pending.append(signum)

    def _job_pids(self) -> List[int]:
        # Our descendants, minus children we already had before the launch (when aiakrun is
        # used in-process): the launcher, its tree, and orphans adopted as subreaper.
        ours = [p for p in proc_tree.children(os.getpid()) if p not in self.preexisting]
        found = list(ours)
        for p in ours:
            found += proc_tree.descendants(p)
        return found

    def _kill_everything(self) -> None:
        pids = self._job_pids()
        proc_tree.kill_all(pids, signal.SIGKILL)
        # SIGKILL is asynchronous: wait, so that nothing is left when aiakrun returns.
        proc_tree.wait_gone(pids, timeout=5.0)

    def run(self) -> JobResult:
        proc_tree.set_child_subreaper()
        old = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True)
            returncode = self._watch(proc)
            failures = read_failures(self.failure_dir)
            if failures or returncode != 0 or self.stop_signal is not None:
                self._kill_everything()  # nothing of a failed job may outlive aiakrun
            proc_tree.reap(self._job_pids())
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        return JobResult(_exit_code(returncode, failures, self.stop_signal), returncode,
                         failures, self.stop_signal)

    def _watch(self, proc: subprocess.Popen) -> int:
        failure_seen = stop_at = terminated_at = None
        killed = False
        while True:
            returncode = proc.poll()
            if returncode is not None:
                return returncode
            now = time.monotonic()
            while self.pending:
                signum = self.pending.pop(0)
                if self.stop_signal is None:
                    self.stop_signal, stop_at = signum, now
                    _send(proc, signum)
                else:  # a second Ctrl-C: the user does not want to wait
                    killed = True
                    self._kill_everything()
            if failure_seen is None and has_failures(self.failure_dir):
                failure_seen = now
            # When the launcher has had its chance to end the job by itself: SIGTERM it.
            deadline = float("inf")
            if failure_seen is not None:
                deadline = failure_seen + self.t.failure_grace
            if stop_at is not None:
                deadline = min(deadline, stop_at + self.t.signal_grace)
            if terminated_at is None and now >= deadline:
                terminated_at = now
                _send(proc, signal.SIGTERM)
            elif (terminated_at is not None and not killed
                  and now >= terminated_at + self.t.terminate_grace):
                killed = True
                self._kill_everything()
            time.sleep(self.t.poll)


def _send(proc: subprocess.Popen, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass


def _exit_code(returncode: int, failures: Sequence[RankFailure], stop_signal: Optional[int]) -> int:
    if failures:
        return shell_status(failures[0].returncode) or 1
    if stop_signal is not None:
        return 128 + stop_signal
    return shell_status(returncode)


def run_job(cmd: Sequence[str], env: Mapping[str, str], failure_dir: str,
            timeouts: Optional[Timeouts] = None) -> JobResult:
    """Run the launcher ``cmd`` to completion under supervision (see module docstring)."""
    return _Supervisor(cmd, env, failure_dir, timeouts or Timeouts()).run()


def report(result: JobResult, launcher: str, out: TextIO = sys.stderr) -> None:
    """One summary line per problem, so the cause is the last thing on the console."""
    if result.failures:
        first = result.failures[0]
        print(f"aiakrun: job failed: {first.describe()}; the other ranks were stopped",
              file=out)
        for other in result.failures[1:]:
            print(f"aiakrun: also: {other.describe()}", file=out)
    elif result.stop_signal is not None:
        print(f"aiakrun: stopped by {signal.Signals(result.stop_signal).name}", file=out)
    elif result.launcher_returncode != 0:
        print(f"aiakrun: {os.path.basename(launcher)} exited with "
              f"{describe_returncode(result.launcher_returncode)}", file=out)
    out.flush()
