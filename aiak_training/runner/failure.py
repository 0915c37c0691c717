"""Rank failure records, shared by the per-rank task wrapper and aiakrun.

The wrapper of a rank that exits abnormally drops a small JSON file into ``$AIAK_FAILURE_DIR``
(a directory aiakrun creates); aiakrun reads them to name the rank that failed first.  When the
directory is not visible (a remote host without a shared file system) the wrapper's stderr
line, forwarded by the MPI launcher, still names the rank.  Standard library only: this is
imported by every rank's wrapper.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, List, Optional, TypeVar

from aiak_training.common.records import drop_record

R = TypeVar("R")

FAILURE_DIR_ENV = "AIAK_FAILURE_DIR"


def describe_returncode(returncode: int) -> str:
    """``exit code 3`` or ``signal SIGKILL`` (Popen's negative return codes are signals)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def shell_status(returncode: int) -> int:
    """Exit status a shell would report: the code itself, or 128 + signal number."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class RankFailure:
    """One rank that ended abnormally."""

    rank: Optional[int]
    host: str
    returncode: int
    time: float
    detail: str = ""

    def describe(self) -> str:
        """``rank 1 (host a) exited with signal SIGKILL``."""
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        if self.detail:
            return f"{who} (host {self.host}) {self.detail}"
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
