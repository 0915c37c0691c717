"""The records ranks leave in aiakrun's failure directory (``$AIAK_FAILURE_DIR``), and their
schema: one module for the writers (the rank wrapper, the watchdog, the exit guard) and the
reader (aiakrun), so that both sides agree on the format.

A failure record is a :class:`RankFailure` as JSON (``rank.<rank>.<pid>[.watchdog].json``);
notes and arrival markers (``.note``, ``.arrival``, see :mod:`exit_guard`) use the same
directory.  Standard library only: the rank wrapper imports it before any framework.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, TypeVar

R = TypeVar("R")

#: The variable naming the directory aiakrun creates for the records (each run its own).
FAILURE_DIR_ENV = "AIAK_FAILURE_DIR"


def drop_record(directory: str, name: str, suffix: str, record: Dict[str, Any]) -> None:
    """Write ``record`` as ``directory/name + suffix``, all at once for readers (written to a
    hidden temporary file, then renamed).  Does nothing when ``directory`` is not there: the
    rank then runs on another host, where aiakrun could not read the file anyway; a write
    that fails is dropped too, since a report must never fail the job."""
    if not directory or not os.path.isdir(directory):
        return
    tmp = os.path.join(directory, f".{name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(directory, name + suffix))
    except OSError:
        pass


def describe_returncode(returncode: int) -> str:
    """``exit code 3`` or ``signal SIGKILL`` (Popen's negative return codes are signals)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class RankFailure:
    """One rank that ended abnormally."""

    rank: Optional[int]
    host: str
    returncode: int
    time: float
    detail: str = ""
    # The exception its program printed last (runner/report/rank_traceback.py), when it printed one:
    # ``ValueError: boom``, when it appeared, and whether it was Horovod's "has been shut
    # down" (a consequence of another rank's failure, not a cause).
    exception: str = ""
    raised_at: float = 0.0
    secondary: bool = False

    @property
    def raised(self) -> bool:
        """Whether the rank died of an exception of its own (not another rank's failure)."""
        return bool(self.exception) and not self.secondary

    def describe(self) -> str:
        """``rank 1 (host a) exited with signal SIGKILL``, or ``rank 1 (host a) raised
        ValueError: boom (exit code 1)``."""
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        if self.detail:
            return f"{who} (host {self.host}) {self.detail}"
        if self.raised:
            return (f"{who} (host {self.host}) raised {self.exception} "
                    f"({describe_returncode(self.returncode)})")
        return f"{who} (host {self.host}) exited with {describe_returncode(self.returncode)}"


def write_failure(directory: str, failure: RankFailure) -> None:
    """Record ``failure`` in ``directory``; silently does nothing if it is not there.

    The directory is never created: if it is missing this rank runs on another host and
    aiakrun could not read the file anyway.
    """
    name = f"rank.{failure.rank if failure.rank is not None else 'unknown'}.{os.getpid()}"
    drop_record(directory, name, ".json", asdict(failure))


def read_records(directory: str, suffix: str, parse: Callable[[Any], R]) -> List[R]:
    """Every JSON file in ``directory`` whose name ends with ``suffix``, as ``parse`` makes
    it, earliest first (by ``time``, then ``rank``).  A file that cannot be read or parsed
    (half written, or from another version) is passed over: a report is better incomplete
    than missing."""
    found: List[R] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return found
    for name in names:
        if not name.endswith(suffix):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                found.append(parse(json.load(f)))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return sorted(found, key=lambda r: (r.time, r.rank if r.rank is not None else -1))


def read_failures(directory: str) -> List[RankFailure]:
    """All complete records in ``directory``, earliest first."""
    return read_records(directory, ".json", lambda raw: RankFailure(**raw))


def has_failures(directory: str) -> bool:
    """Cheap check used while polling."""
    try:
        return any(n.endswith(".json") for n in os.listdir(directory))
    except OSError:
        return False


def now() -> float:
    """Wall-clock time for ordering records written by different processes."""
    return time.time()
