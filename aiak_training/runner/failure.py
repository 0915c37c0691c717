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
from typing import Any, Callable, List, Optional, Sequence, TypeVar

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
    # The exception its program printed last (runner/rank_traceback.py), when it printed one:
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


#: A rank killed by a signal counts as this many seconds earlier than its wrapper saw it end:
#: its peers' connections break at the same instant, and their errors (printed at once) can
#: beat the wrapper's own clock by milliseconds.
SIGNAL_LEAD_S = 1.0


def first_cause(failures: Sequence[RankFailure]) -> Optional[RankFailure]:
    """The failure that came first, by when it happened: a rank's own exception when it
    appeared (the rank may end much later, waiting in ``MPI_Finalize``), any other failure
    when its rank ended (a signal :data:`SIGNAL_LEAD_S` earlier).  Ranks that died of
    Horovod's "has been shut down" are consequences of another failure and count only when
    nothing else failed."""
    causes = [f for f in failures if not f.secondary] or list(failures)
    if not causes:
        return None

    def happened(f: RankFailure) -> float:
        if f.raised:
            return f.raised_at
        return f.time - (SIGNAL_LEAD_S if f.returncode < 0 else 0.0)

    return min(causes, key=lambda f: (happened(f), f.time))


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
