"""Bounded process exit after a failed collective, and the notes aiakrun uses to blame a rank.

Why.  After a collective error or a stall shutdown, the program usually ends on the
``HorovodInternalError``.  Its interpreter then calls ``MPI_Finalize`` (mpi4py does, at the
very end of Python's exit), and MPICH's ``MPI_Finalize`` waits for every peer to reach it.  A
peer that is stuck in user code (or gone without the launcher noticing) keeps this rank
waiting until it wakes, which defeats the stall shutdown.  So once this process has seen a
``HorovodInternalError``, ``MPI_Finalize`` runs on a helper thread (through ctypes, which
releases the GIL) and the main thread waits at most ``AIAK_EXIT_TIMEOUT_SECONDS`` (default 3,
0 waits forever as before).  When it returns in time, nothing changes: the process keeps its
own exit status.  When it does not, the process ends at once with exit code 1 and one line
on stderr; the task wrapper reports that to aiakrun, and the launcher stops the stuck peer.

A normal end is never bounded: a rank that finishes early may legitimately wait in
``MPI_Finalize`` while a peer writes its checkpoint.  Only a failure noticed after the last
clean shutdown counts, so an elastic job that recovered and ended cleanly is not affected.

Notes for aiakrun.  Where aiakrun's failure directory (``$AIAK_FAILURE_DIR``) is visible,
each rank leaves small ``*.note`` files (not ``*.json``: they are not failures by themselves):
``finished`` when its program called ``hvd.shutdown()`` with the engine still running, and
``error`` with the first ``HorovodInternalError`` message and, after a stall report, the ranks
that were missing.  aiakrun combines them with the failure records to name the rank that
caused a failure (runner/report/blame.py).  The stall report is read from the ``aiak_training``
logger, so that the engines need no extra hook.

Standard library and (lazily) mpi4py only: ``common`` may not import the runtime.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import sys
import threading
import time
from typing import Dict, List, Optional

from aiak_training.common.env import env_float
from aiak_training.common.job.records import FAILURE_DIR_ENV, drop_record

EXIT_TIMEOUT_ENV = "AIAK_EXIT_TIMEOUT_SECONDS"
DEFAULT_EXIT_TIMEOUT_S = 3.0
#: Exit status of a process whose ``MPI_Finalize`` did not return in time.
STUCK_FINALIZE_EXIT_CODE = 1
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "HOROVOD_RANK")

_lock = threading.Lock()
_failure_at: Optional[float] = None       # monotonic time of the first failure since ...
_clean_shutdown_at: Optional[float] = None  # ... the last shutdown of a running engine
_error_noted = False
_last_stall: Dict[int, List[str]] = {}   # rank -> tensor names it did not submit


# ---- what happened ---------------------------------------------------------------------------
def note_failure(message: str) -> None:
    """A ``HorovodInternalError`` was created on this process (called by its constructor)."""
    global _failure_at, _error_noted
    with _lock:
        if _failure_at is None:
            _failure_at = time.monotonic()
        first = not _error_noted
        _error_noted = True
    if first:
        _write_note("error", {"message": message[:2000],
                              "missing": {str(r): n for r, n in _last_stall.items()}})


def note_shutdown(engine_running: bool) -> None:
    """``hvd.shutdown()`` stops an engine; ``engine_running`` tells whether it still ran (the
    program ended normally) or had stopped by itself (a failure or a peer's shutdown)."""
    global _clean_shutdown_at, _failure_at
    if not engine_running:
        return
    with _lock:
        _clean_shutdown_at = time.monotonic()
        _failure_at = None
    _write_note("finished", {})


def failed_since_clean_shutdown() -> bool:
    """Whether this process saw a collective failure after its last clean shutdown."""
    return _failure_at is not None


def exit_timeout(environ=None) -> float:
    """``AIAK_EXIT_TIMEOUT_SECONDS`` (0: no bound)."""
    return env_float(EXIT_TIMEOUT_ENV, DEFAULT_EXIT_TIMEOUT_S, minimum=0.0, environ=environ)


# ---- stall reports, read from the log ---------------------------------------------------------
_MISSING_LINE = re.compile(r"^\s*(\d+): \[(.*)\]\s*$")


def parse_missing_ranks(report: str) -> Dict[int, List[str]]:
    """``{rank: [tensor names]}`` from a stall report's ``Missing ranks:`` section."""
    out: Dict[int, List[str]] = {}
    if "Missing ranks:" not in report:
        return out
    for line in report.split("Missing ranks:", 1)[1].splitlines():
        m = _MISSING_LINE.match(line)
        if m:
            out[int(m.group(1))] = [n.strip() for n in m.group(2).split(",") if n.strip()]
    return out


class _StallListener(logging.Filter):
    """Keeps the latest ``Missing ranks`` of the stall inspector; filters nothing out."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if record.levelno >= logging.WARNING:  # stall reports are warnings, and rare
                missing = parse_missing_ranks(record.getMessage())
                if missing:
                    _last_stall.clear()
                    _last_stall.update(missing)
        except Exception:  # noqa: BLE001 - a diagnostic must never break logging
            pass
        return True


# ---- notes for aiakrun --------------------------------------------------------------------------
def _rank() -> Optional[int]:
    for name in _RANK_VARS:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def _write_note(event: str, extra: dict) -> None:
    directory = os.environ.get(FAILURE_DIR_ENV, "")
    if not directory or not os.path.isdir(directory):
        return
    rank = _rank()
    record = {"rank": rank, "host": os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(),
              "event": event, "time": time.time(), "pid": os.getpid(), **extra}
    name = f"rank.{rank if rank is not None else 'unknown'}.{os.getpid()}.{event}"
    drop_record(directory, name, ".note", record)


#: Set by aiakrun's task wrapper for the rank's program only: leave an arrival note.
ARRIVAL_ENV = "AIAK_NOTE_ARRIVAL"
ARRIVAL_SUFFIX = ".arrival"


def note_arrival(stage: str) -> None:
    """This rank reached the point where it waits for its peers (``MPI_Init``, the Gloo
    rendezvous): aiakrun ends the job when a rank has not done so ``HOROVOD_START_TIMEOUT``
    seconds after the first one did (runner/guard/start_watch.py).  Only under aiakrun's task
    wrapper, once per process."""
    global _arrival_noted
    if _arrival_noted or not os.environ.get(ARRIVAL_ENV):
        return
    _arrival_noted = True
    directory = os.environ.get(FAILURE_DIR_ENV, "")
    rank = _rank()
    if rank is None:
        return
    record = {"rank": rank, "host": os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(),
              "stage": stage, "time": time.time(), "pid": os.getpid()}
    drop_record(directory, f"rank.{rank}.{os.getpid()}", ARRIVAL_SUFFIX, record)


_arrival_noted = False


# ---- the bounded exit ---------------------------------------------------------------------------
def _mpi_to_finalize():
    """The ctypes ``MPI_Finalize`` of the MPI mpi4py loaded, if MPI is running; else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return None
        import ctypes
        # The extension module links libmpi: dlsym through its handle finds MPI_Finalize.
        # A ctypes call releases the GIL, so the main thread can keep time meanwhile.
        return ctypes.CDLL(mpi.__file__).MPI_Finalize
    except Exception:  # noqa: BLE001 - no MPI to finalize: Python exits as usual
        return None


def bounded_finalize(timeout_s: float, out=None) -> bool:
    """Run ``MPI_Finalize`` on a helper thread; end the process if it does not return within
    ``timeout_s`` seconds.  Returns True when it returned (or there was nothing to do)."""
    finalize = _mpi_to_finalize()
    if finalize is None:
        return True
    done = threading.Event()

    def run() -> None:
        finalize()
        done.set()

    try:
        threading.Thread(target=run, name="aiak-finalize", daemon=True).start()
    except RuntimeError:  # no new threads this late (newer Pythons): do not risk the wait
        done.wait(0)
    if done.wait(timeout_s):
        return True
    rank = _rank()
    who = f"rank {rank}" if rank is not None else "this process"
    line = (f"[aiak_training ERROR] {who}: MPI_Finalize did not return within {timeout_s:g} s "
            f"after a collective failed (a peer is stuck or gone; {EXIT_TIMEOUT_ENV}); ending "
            f"the process with exit code {STUCK_FINALIZE_EXIT_CODE}\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not prevent the exit
            pass
    try:
        os.write(2 if out is None else out, line.encode("utf-8", "replace"))
    except OSError:
        pass
    os._exit(STUCK_FINALIZE_EXIT_CODE)


def _at_exit() -> None:
    # Registered when this module is first imported, which is before hvd.init registers
    # hvd.shutdown: atexit runs handlers last-in first-out, so this runs after the engine has
    # stopped and before mpi4py's own MPI_Finalize (a Py_AtExit hook, later still).
    if not failed_since_clean_shutdown():
        return
    try:
        timeout = exit_timeout()
    except ValueError as exc:
        sys.stderr.write(f"[aiak_training WARNING] {exc}; using {DEFAULT_EXIT_TIMEOUT_S:g}\n")
        timeout = DEFAULT_EXIT_TIMEOUT_S
    if timeout > 0:
        bounded_finalize(timeout)


atexit.register(_at_exit)
logging.getLogger("aiak_training").addFilter(_StallListener())
