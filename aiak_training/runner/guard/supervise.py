"""Run the MPI launcher as a child, forward signals, and make sure a failed job ends entirely.

The launcher runs in its own session so that a terminal's Ctrl-C reaches aiakrun only and is
forwarded once (rather than hitting every process at the same time).  aiakrun registers as
child subreaper: processes orphaned when the launcher dies are re-parented to it, so the
final sweep finds them even though hydra starts every rank in a session of its own.
"""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from aiak_training.common.job.records import (RankFailure, describe_returncode, has_failures,
                                              read_failures)
from aiak_training.runner.guard import proc_tree
from aiak_training.runner.report.blame import culprit_line, read_notes
from aiak_training.runner.report.failure import first_cause, shell_status

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


@dataclass(frozen=True)
class LostHost:
    """A host whose MPI proxy ended first while the job was running."""

    host: str
    ranks: Tuple[int, ...]
    pid: int
    seconds_before_launcher: float  # how long before the launcher itself ended

    def describe(self) -> str:
        """``lost host b (ranks 2-3): its MPI proxy (pid 123) ended 0.07 s before ...``."""
        if not self.ranks:
            who = "no ranks"
        elif len(self.ranks) > 1 and self.ranks == tuple(range(self.ranks[0],
                                                                self.ranks[-1] + 1)):
            who = f"ranks {self.ranks[0]}-{self.ranks[-1]}"
        else:
            who = ("rank " if len(self.ranks) == 1 else "ranks ") + \
                ", ".join(str(r) for r in self.ranks)
        return (f"lost host {self.host} ({who}): its MPI proxy (pid {self.pid}) ended "
                f"{self.seconds_before_launcher:.2f} s before the launcher, while the job ran "
                "(the host, or every process of the job on it, went away)")


@dataclass
class JobResult:
    """How the job ended."""

    exit_code: int
    launcher_returncode: int
    failures: List[RankFailure] = field(default_factory=list)
    stop_signal: Optional[int] = None
    lost_hosts: List[LostHost] = field(default_factory=list)
    # The rank that caused the failure when it is not the first to fail (runner/report/blame.py).
    culprit: Optional[str] = None
    hints: List[str] = field(default_factory=list)  # one-line advice printed after the summary
    # A host the launcher's ssh could not reach (runner/cli/hosts.py: unreachable), when no rank
    # reported anything: the job never started there.
    unreachable: Optional[str] = None

    @property
    def cause(self) -> Optional[RankFailure]:
        """The failure the summary leads with (:func:`failure.first_cause`)."""
        return first_cause(self.failures)


class ProxyWatch:
    """Notes when each of MPICH hydra's per-host proxies ends, to the millisecond.

    When a whole host goes away (its processes killed, or the machine gone), no rank on it
    can report anything, and hydra's launcher just exits with an internal assertion.  Its
    proxy names the host: it is the one that ended clearly first, before the launcher and
    the other proxies (see :meth:`lost`).  hydra numbers its proxies
    (``--proxy-id N``) in the order of its host list, which is ``hosts`` here.  Processes
    are found in the launcher's tree (the local proxy, and the ``ssh``/launch-agent process
    of each remote one, whose command line carries the same ``--proxy-id``); their ends and
    the launcher's are watched through pidfds, so the order is exact even when they are
    10 ms apart.  Linux only; elsewhere it watches nothing.
    """

    _PROXY_ID = re.compile(rb"hydra_pmi_proxy\b.*?--proxy-id[\s=](\d+)")

    def __init__(self, launcher_pid: int, hosts: Sequence[Tuple[str, Sequence[int]]]):
        self._launcher = launcher_pid
        self._hosts = [(name, tuple(ranks)) for name, ranks in hosts]
        self._fds: Dict[int, Tuple[int, int]] = {}   # pidfd -> (pid, proxy id)
        self._seen: Dict[int, int] = {}              # pid -> proxy id
        self.ended: Dict[int, Tuple[float, int]] = {}  # proxy id -> (monotonic time, pid)
        self.launcher_ended: Optional[float] = None
        self._launcher_fd: Optional[int] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aiakrun-proxies",
                                        daemon=True)
        if hosts and hasattr(os, "pidfd_open"):
            try:
                self._launcher_fd = os.pidfd_open(launcher_pid)
            except OSError:
                return
            self._thread.start()

    def _discover(self) -> None:
        for pid in proc_tree.descendants(self._launcher):
            if pid in self._seen:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ")
            except OSError:
                continue
            m = self._PROXY_ID.search(cmdline)
            if not m or int(m.group(1)) >= len(self._hosts):
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            self._seen[pid] = int(m.group(1))
            self._fds[fd] = (pid, int(m.group(1)))

    def _run(self) -> None:
        started = last_scan = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                # Proxies start within the first seconds (a launch agent execs, so its pid
                # shows the proxy's command line a moment later).  Once all are found the
                # tree is not scanned again; if some never show up (another hydra), only
                # rarely, so that a long job does not pay for the scans.
                if len(set(self._seen.values())) < len(self._hosts) and \
                        now - last_scan >= (0.2 if now - started < 60 else 10.0):
                    self._discover()
                    last_scan = now
                watched = list(self._fds)
                if self.launcher_ended is None and self._launcher_fd is not None:
                    watched.append(self._launcher_fd)
                ready = select.select(watched, [], [], 0.2)[0] if watched else []
                if not watched:
                    self._stop.wait(0.2)
                stamp = time.monotonic()
                for fd in ready:
                    if fd == self._launcher_fd:
                        self.launcher_ended = stamp
                        continue
                    pid, proxy = self._fds.pop(fd)
                    os.close(fd)
                    if proxy not in self.ended or stamp < self.ended[proxy][0]:
                        self.ended[proxy] = (stamp, pid)
        except (OSError, ValueError):
            return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        for fd in list(self._fds) + ([self._launcher_fd] if self._launcher_fd else []):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._launcher_fd = None

    def all_ended(self) -> bool:
        """Whether every proxy found has ended (True if none was found)."""
        return set(self.ended) >= set(self._seen.values())

    def lost(self, margin: float = 0.01) -> List[LostHost]:
        """Hosts whose proxy ended clearly first: at least ``margin`` seconds before the
        launcher and before every other proxy (earliest first); empty otherwise.

        When a host vanishes, its proxy's end leads the launcher's by tens of ms, and the
        other proxies end with or after the launcher.  When hydra tears a job down itself,
        the proxies end together.  Ends seen in one wake-up of the watcher share a stamp, so
        they never count as separated.  It is a heuristic, used only when no rank left a
        failure record.
        """
        end = self.launcher_ended
        proxies = set(self._seen.values())
        if end is None or not proxies:
            return []
        never = float("inf")
        ends = sorted((self.ended.get(proxy, (never, -1)) + (proxy,)) for proxy in proxies)
        for i, (when, _, _) in enumerate(ends):
            if when > end - margin:
                return []
            if i + 1 == len(ends):
                return []  # every proxy ended early: hydra's own teardown
            if ends[i + 1][0] - when >= margin:
                return [LostHost(self._hosts[proxy][0], self._hosts[proxy][1], pid, end - t)
                        for t, pid, proxy in ends[:i + 1]]
        return []


class _Supervisor:
    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], failure_dir: str,
                 timeouts: Timeouts, proxy_hosts: Sequence[Tuple[str, Sequence[int]]] = (),
                 output=None, start=None):
        self.cmd, self.env, self.failure_dir, self.t = list(cmd), dict(env), failure_dir, timeouts
        self.start = start  # a start_watch.StartWatch, or None
        self.output = output  # a launcher_output.LauncherOutput, or None to inherit stdio
        self.proxy_hosts = list(proxy_hosts)
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
            pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} if self.output else {}
            # The launcher gets SIGTERM when aiakrun dies (even by SIGKILL), so it tears the job
            # down; the wrappers' liveness connections (runner/guard/liveness.py) cover the rest.
            proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True,
                                    preexec_fn=proc_tree.term_with_parent, **pipes)
            if self.output:
                self.output.start(os.dup(proc.stdout.fileno()), os.dup(proc.stderr.fileno()))
                proc.stdout.close()
                proc.stderr.close()
            proxies = ProxyWatch(proc.pid, self.proxy_hosts)
            try:
                returncode = self._watch(proc)
                failures = read_failures(self.failure_dir)
                if self.start is not None and failures and self.stop_signal is None:
                    # The job ended on a failure (maybe a rank's own rendezvous timeout):
                    # if that came after the start deadline, the missing ranks are the cause.
                    if self.start.check(wall_now=failures[0].time, force_read=True):
                        failures = read_failures(self.failure_dir)
                if returncode != 0 and not failures and self.stop_signal is None:
                    # No rank said what happened: the proxies tell (see ProxyWatch).  Those
                    # that outlive the launcher end right after it; let the watcher see them
                    # go, to tell "ended before" from "ended after".
                    deadline = time.monotonic() + 1.0
                    while time.monotonic() < deadline and not proxies.all_ended():
                        time.sleep(0.02)
            finally:
                proxies.stop()
            lost = proxies.lost() if returncode != 0 and not failures else []
            failures = read_failures(self.failure_dir)  # again: ranks may have ended since
            if failures or returncode != 0 or self.stop_signal is not None:
                self._kill_everything()  # nothing of a failed job may outlive aiakrun
            proc_tree.reap(self._job_pids())
            if self.output:
                self.output.join(timeout=2.0)  # the summary comes after the job's output
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        culprit = None
        if failures and self.stop_signal is None:
            culprit = culprit_line(failures, read_notes(self.failure_dir))
        return JobResult(_exit_code(returncode, failures, self.stop_signal), returncode,
                         failures, self.stop_signal,
                         lost if self.stop_signal is None else [], culprit)

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
            if (self.start is not None and terminated_at is None and self.stop_signal is None
                    and self.start.check()):
                # Ranks never arrived: the others wait in MPI_Init or the rendezvous, which
                # nothing ends by itself.  Stop the launcher now.
                failure_seen = failure_seen or now
                terminated_at = now
                _send(proc, signal.SIGTERM)
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
            timeouts: Optional[Timeouts] = None,
            proxy_hosts: Sequence[Tuple[str, Sequence[int]]] = (),
            output=None, start=None) -> JobResult:
    """Run the launcher ``cmd`` to completion under supervision (see module docstring).

    ``proxy_hosts``: for MPICH's hydra, the hosts in launch order with their ranks, so that
    a host that vanished as a whole can be named (:class:`ProxyWatch`).
    ``output``: a :class:`launcher_output.LauncherOutput` that reads the launcher's stdout
    and stderr (termination banners filtered out); None lets the launcher write directly.
    ``start``: a :class:`start_watch.StartWatch` that ends the job when ranks never arrive.
    """
    return _Supervisor(cmd, env, failure_dir, timeouts or Timeouts(), proxy_hosts,
                       output, start).run()


def report(result: JobResult, launcher: str, out: TextIO = sys.stderr) -> None:
    """One summary line per problem, the cause last, so that it is the last thing on the
    console: the ``job failed:`` line names the rank that failed first and what it died of
    (its exception, signal or exit code; or, from the notes, the rank that caused it)."""
    if result.failures:
        cause = result.cause
        for other in result.failures:
            if other is not cause or result.culprit:
                print(f"aiakrun: also: {other.describe()}", file=out)
        headline = result.culprit or cause.describe()
        print(f"aiakrun: job failed: {headline}; the other ranks were stopped", file=out)
    elif result.stop_signal is not None:
        print(f"aiakrun: stopped by {signal.Signals(result.stop_signal).name}", file=out)
    elif result.unreachable and result.launcher_returncode != 0:
        print(f"aiakrun: job failed: {result.unreachable}; {os.path.basename(launcher)} "
              f"exited with {describe_returncode(result.launcher_returncode)}", file=out)
    elif result.lost_hosts:
        print(f"aiakrun: job failed: {result.lost_hosts[0].describe()}; "
              f"{os.path.basename(launcher)} exited with "
              f"{describe_returncode(result.launcher_returncode)}; the other ranks were stopped",
              file=out)
        for other in result.lost_hosts[1:]:
            print(f"aiakrun: also: {other.describe()}", file=out)
    elif result.launcher_returncode != 0:
        print(f"aiakrun: {os.path.basename(launcher)} exited with "
              f"{describe_returncode(result.launcher_returncode)}", file=out)
    for hint in result.hints:
        print(hint, file=out)
    out.flush()
