"""Per-rank wrapper: ``python -m aiak_training.runner.guard.task_wrapper [--] CMD [ARGS...]``.

aiakrun starts every rank through this module so that failure handling does not depend on the
MPI flavour:

* the real command runs as a child that is SIGKILLed if the wrapper dies (PR_SET_PDEATHSIG),
  and receives the signals the wrapper gets (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1/2);
* when it exits abnormally and was not asked to stop, the wrapper prints
  ``aiakrun: rank R (host H) exited with exit code N | signal NAME`` to stderr, leaves a record
  for aiakrun, and then dies by a signal.  MPICH's hydra aborts a job when a process is killed
  but not when one merely exits non-zero, while Open MPI aborts on both, so dying by a signal
  makes every launcher stop the remaining ranks at once;
* only rank 0 gets the job's standard input (the other ranks an empty one), except for a
  ``python -`` program, which every rank reads from aiakrun's copy (:mod:`stdin_program`);
* the rank's stdout/stderr are passed on in whole lines (:mod:`line_pump`), so rank labels
  added by the MPI launcher are not scattered through unbuffered output;
* ``--output-filename`` is implemented here (``$AIAK_OUTPUT_FILENAME/rank.<N>/{stdout,stderr}``,
  also still shown on the console);
* it holds a connection to aiakrun (``$AIAK_LAUNCHER_LIVENESS``, :mod:`liveness`) and stops
  the rank's whole process tree when aiakrun dies, however it dies;
* after a forwarded Ctrl-C, tracebacks ending in ``KeyboardInterrupt`` are not shown
  (:mod:`interrupt_filter`);
* the exception the rank dies of goes into its failure record, and tracebacks of Horovod's
  "has been shut down" error (another rank failed first) are cut to one line
  (:mod:`rank_traceback`);
* with Open MPI ``--virtual-hosts`` the rank's host identity arrives as a map
  (``$AIAK_VIRTUAL_HOST_MAP``, e.g. ``a:2,b:2``) and is set as ``HOROVOD_HOSTNAME`` here.

Standard library only, and it imports nothing heavy: it starts once per rank.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, List, Mapping, Optional, Sequence

from aiak_training.common.job.exit_guard import ARRIVAL_ENV
from aiak_training.common.job.records import FAILURE_DIR_ENV, RankFailure, now, write_failure
from aiak_training.runner.cli.stdin_program import rank_stdin
from aiak_training.runner.guard import liveness, proc_tree
from aiak_training.runner.report.failure import shell_status
from aiak_training.runner.report.line_pump import pump_lines, write_all
from aiak_training.runner.report.rank_traceback import RankException, StderrFilter

RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "HOROVOD_RANK")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE")
OUTPUT_DIR_ENV = "AIAK_OUTPUT_FILENAME"
VIRTUAL_HOST_MAP_ENV = "AIAK_VIRTUAL_HOST_MAP"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)
# Signals that mean "the job is being stopped": a child dying after one of these is not a failure.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Signals the wrapper may re-raise on itself without leaving a core file.
_CLEAN_DEATH_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                        signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE, signal.SIGALRM)
PR_SET_PDEATHSIG = 1


def _first_int(env: Mapping[str, str], names: Sequence[str]) -> Optional[int]:
    for name in names:
        value = env.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return None


def rank_from_env(env: Mapping[str, str]) -> Optional[int]:
    """This process's MPI rank from the launcher's variables (MPICH, Open MPI, PMIx, Horovod)."""
    return _first_int(env, RANK_VARS)


def size_from_env(env: Mapping[str, str]) -> Optional[int]:
    """The job size, when the launcher exports it."""
    return _first_int(env, SIZE_VARS)


def virtual_host_for(rank: int, host_map: str) -> Optional[str]:
    """Host name of ``rank`` in a ``a:2,b:2`` map (ranks fill hosts in order); None if outside."""
    first = 0
    for entry in host_map.split(","):
        name, _, slots = entry.strip().rpartition(":")
        if not name or not slots.isdigit():
            return None
        if first <= rank < first + int(slots):
            return name
        first += int(slots)
    return None


def rank_dir_name(rank: Optional[int], size: Optional[int]) -> str:
    """``rank.<N>``, zero-padded to the width of the largest rank so listings sort (as Horovod)."""
    if rank is None:
        return f"rank.unknown.{os.getpid()}"
    width = len(str(size - 1)) if size and size > 1 else 1
    return f"rank.{rank:0{width}d}"


class _Child:
    """The wrapped command, its signal forwarding and its output (line by line, see line_pump)."""

    def __init__(self, argv: List[str], env: Mapping[str, str], output_dir: Optional[str],
                 stdin=None):
        self.stop_signal: Optional[int] = None
        self.stop_at: Optional[float] = None  # wall clock of the first stop signal
        self.ended_at = 0.0                   # wall clock of the rank's end
        # After a forwarded Ctrl-C, Python's KeyboardInterrupt tracebacks are not shown; the
        # exception the rank dies of is noted, and secondary tracebacks are cut.
        self.stderr_filter = StderrFilter()
        self._threads: List[threading.Thread] = []
        self._logs: List[IO[bytes]] = []
        parent = os.getpid()
        libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls it

        def die_with_parent() -> None:
            # A process group of its own: hydra signals the wrapper's whole group, and the
            # wrapper forwards too, so the rank would get a Ctrl-C twice (a second
            # KeyboardInterrupt in the middle of printing the first).
            os.setpgid(0, 0)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the wrapper died before prctl took effect
                os.kill(os.getpid(), signal.SIGKILL)

        if output_dir:
            os.makedirs(output_dir, exist_ok=True)
        # Handlers go in before the child exists, so a signal cannot slip between the two.
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._forward)
        # close_fds=False: descriptors the launcher passed down (MPICH's PMI_FD) must reach the
        # rank.  Python opens its own files non-inheritable, so nothing of ours leaks.
        self.proc = subprocess.Popen(argv, env=dict(env), preexec_fn=die_with_parent,
                                     close_fds=False, stdin=stdin, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        if hasattr(stdin, "close"):
            stdin.close()  # the child has its own copy of the descriptor
        if self.stop_signal is not None:  # asked to stop while the child was being created
            self.proc.send_signal(self.stop_signal)
        for name, stream, console in (("stdout", self.proc.stdout, 1),
                                      ("stderr", self.proc.stderr, 2)):
            log = None
            if output_dir:
                log = open(os.path.join(output_dir, name), "wb", buffering=0)
                self._logs.append(log)
            fd = os.dup(stream.fileno())
            stream.close()
            t = threading.Thread(target=pump_lines, args=(fd, console, log), daemon=True,
                                 kwargs={"console_filter": self.stderr_filter
                                         if console == 2 else None})
            t.start()
            self._threads.append(t)

    def _forward(self, signum: int, _frame) -> None:
        if signum in STOP_SIGNALS and self.stop_signal is None:
            self.stop_signal, self.stop_at = signum, now()
        if signum == signal.SIGINT:
            self.stderr_filter.activate()
        proc = getattr(self, "proc", None)
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def stop_tree(self) -> None:
        """aiakrun is gone: end the rank and everything it started (SIGTERM, then SIGKILL)."""
        if self.stop_signal is None:
            # Not this rank's failure: no report.
            self.stop_signal, self.stop_at = signal.SIGTERM, now()
        pids = [self.proc.pid] + proc_tree.descendants(self.proc.pid)
        proc_tree.kill_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + liveness.KILL_GRACE_S
        while time.monotonic() < deadline:
            # Not reaped here: the main thread's wait() collects the rank's status.
            pids = [p for p in pids if proc_tree.is_alive(p)]
            if not pids:
                return
            time.sleep(0.05)
        proc_tree.kill_all(pids + proc_tree.descendants(self.proc.pid), signal.SIGKILL)

    def wait(self) -> int:
        returncode = self.proc.wait()
        # Stamped before the output is drained: peers' exceptions caused by this end must
        # not seem to come first (runner/report/failure.first_cause orders by these times).
        self.ended_at = now()
        for t in self._threads:
            # Grandchildren may keep the pipe open; do not wait for them forever.
            t.join(timeout=2.0)
        for log in self._logs:
            log.close()
        return returncode


def _report(failure: RankFailure) -> None:
    # One write() for the whole line: MPI launchers label output per chunk they read, so a
    # separate newline write would come out as a stray "[1] " line.
    try:
        write_all(2, f"aiakrun: {failure.describe()}\n".encode("utf-8", "replace"))
    except OSError:
        pass


def _die(returncode: int) -> None:
    """End this process so that the MPI launcher treats the rank as failed and aborts the job."""
    sig = signal.SIGTERM
    if returncode < 0 and -returncode in _CLEAN_DEATH_SIGNALS:
        sig = -returncode  # the launcher then reports the same signal as we did
    if sig != signal.SIGKILL:  # SIGKILL's disposition cannot (and need not) be changed
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(shell_status(returncode) or 1)  # only reached if the signal did not kill us


def _raised_before_stop(raised: Optional[RankException], stop_at: Optional[float]) -> bool:
    """Whether the rank's program died of its own exception before the job was stopped."""
    return (raised is not None and not raised.secondary and stop_at is not None
            and raised.time <= stop_at and not raised.line.startswith("KeyboardInterrupt"))


def _connect_launcher(value: str, rank: Optional[int], host: str):
    """The liveness connection to aiakrun (runner/guard/liveness.py): a socket, None when there is
    none to hold (not started by aiakrun, or unreachable), False when aiakrun is gone."""
    if not value:
        return None
    who = f"rank {rank}" if rank is not None else "a rank"
    try:
        sock, why = liveness.connect(value, rank)
    except ConnectionRefusedError:
        return False
    except ValueError as exc:
        liveness.warn(f"{who} (host {host}): {exc}")
        return None
    if sock is None:
        liveness.warn(f"{who} (host {host}) cannot reach aiakrun's liveness port ({why}); "
                      "it will not stop by itself if aiakrun dies")
    return sock


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command; returns its status when it ends normally or the job was stopped."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m aiak_training.runner.guard.task_wrapper [--] CMD [ARGS...]",
              file=sys.stderr)
        return 2
    env = dict(os.environ)
    rank, size = rank_from_env(env), size_from_env(env)
    host_map = env.pop(VIRTUAL_HOST_MAP_ENV, "")
    if host_map and rank is not None:
        virtual = virtual_host_for(rank, host_map)
        if virtual:
            env["HOROVOD_HOSTNAME"] = virtual
    host = env.get("HOROVOD_HOSTNAME") or socket.gethostname()
    output_root = env.get(OUTPUT_DIR_ENV)
    output_dir = os.path.join(output_root, rank_dir_name(rank, size)) if output_root else None
    failure_dir = env.get(FAILURE_DIR_ENV, "")
    if failure_dir:
        env[ARRIVAL_ENV] = "1"  # the program notes when it reaches MPI_Init or the rendezvous
    launcher_link = _connect_launcher(env.pop(liveness.LIVENESS_ENV, ""), rank, host)
    if launcher_link is False:
        return 1  # aiakrun is already gone: do not start the rank at all

    try:
        # Standard input: a `python -` program for every rank, else rank 0's only.
        child = _Child(args, env, output_dir, stdin=rank_stdin(env, rank))
    except OSError as exc:
        failure = RankFailure(rank, host, 127, now(),
                              detail=f"could not start {args[0]!r}: {exc.strerror or exc}")
        _report(failure)
        write_failure(failure_dir, failure)
        _die(127)
        return 127
    if launcher_link is not None:
        liveness.watch(launcher_link, child.stop_tree)
    returncode = child.wait()
    if returncode == 0:
        return 0
    raised = child.stderr_filter.watch.last
    cause = {} if raised is None else {"exception": raised.line, "raised_at": raised.time,
                                       "secondary": raised.secondary}
    if child.stop_signal is not None:
        # The job is being stopped (Ctrl-C, or the launcher tearing down after another rank
        # failed): not this rank's fault, so no report that could hide the real cause ...
        if _raised_before_stop(raised, child.stop_at):
            # ... unless its program had already died of an exception of its own, and was
            # stopped while it waited to end (in MPI_Finalize): a silent record, so that
            # aiakrun's summary can name it.
            write_failure(failure_dir, RankFailure(rank, host, returncode, now(), **cause))
        return shell_status(returncode)
    failure = RankFailure(rank, host, returncode, child.ended_at, **cause)
    _report(failure)
    write_failure(failure_dir, failure)
    _die(returncode)
    return shell_status(returncode)


if __name__ == "__main__":
    sys.exit(main())
