"""``HOROVOD_START_TIMEOUT``: a rank that never arrives ends the job, named with its host.

The ranks of a job meet first in ``MPI_Init`` (MPI mode) or at the Gloo rendezvous
(``--gloo``).  A rank that never gets there (stuck reading input, in a long import, or ended
without calling ``hvd.init()``) would leave the others waiting there forever.  Each rank's
program leaves an arrival note in aiakrun's failure directory just before it starts to wait
(``common/job/exit_guard.note_arrival``; the task wrapper asks for it with
``$AIAK_NOTE_ARRIVAL``).  Once the first rank has arrived, :class:`StartWatch` gives the
others ``HOROVOD_START_TIMEOUT`` seconds (aiakrun's ``--start-timeout``, default 30); then it
records every missing rank as failed, and aiakrun stops the job.

It only acts on what it can see: ranks on another host without a shared file system leave
no visible notes, and a job whose ranks never load aiak_training leaves none at all; then
nothing is timed.
"""
from __future__ import annotations

import time
from typing import Dict, List, Mapping, Optional

from aiak_training.common.job.exit_guard import ARRIVAL_ENV, ARRIVAL_SUFFIX
from aiak_training.common.job.records import RankFailure, read_failures, read_records, write_failure

__all__ = ["ARRIVAL_ENV", "StartWatch", "arrivals", "start_timeout", "watch_start"]

START_TIMEOUT_ENV = "HOROVOD_START_TIMEOUT"
#: How often the failure directory is read while ranks are still missing.
POLL_S = 0.5


def start_timeout(env: Mapping[str, str]) -> Optional[float]:
    """``HOROVOD_START_TIMEOUT`` in seconds from the ranks' environment (aiakrun sets it);
    None when unset, not a number or not positive (no limit)."""
    try:
        value = float(env.get(START_TIMEOUT_ENV, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def arrivals(failure_dir: str) -> List[RankFailure]:
    """The arrival notes in ``failure_dir``, earliest first (as records with rank, host and
    time)."""
    return read_records(failure_dir, ARRIVAL_SUFFIX,
                        lambda raw: RankFailure(int(raw["rank"]), str(raw["host"]), 0,
                                                float(raw["time"])))


class StartWatch:
    """Declares the ranks that have not arrived ``timeout_s`` after the first one did."""

    def __init__(self, failure_dir: str, rank_hosts: Mapping[int, str], timeout_s: float,
                 stage: str):
        self.failure_dir = failure_dir
        self.rank_hosts = dict(rank_hosts)
        self.timeout_s = timeout_s
        self.stage = stage          # where the ranks meet: "MPI_Init", "the Gloo rendezvous"
        self.arrived: Dict[int, float] = {}  # rank -> when it arrived (wall clock)
        self.declared: List[int] = []       # ranks recorded as never arrived
        self._read_at = 0.0

    def _read(self) -> None:
        for note in arrivals(self.failure_dir):
            self.arrived.setdefault(note.rank, note.time)
            self.rank_hosts.setdefault(note.rank, note.host)

    def missing(self) -> List[int]:
        return sorted(set(self.rank_hosts) - set(self.arrived))

    def check(self, wall_now: Optional[float] = None, force_read: bool = False) -> bool:
        """Read the notes (at most every :data:`POLL_S`); when the time is up, record the
        missing ranks as failed and return True (once)."""
        if self.declared or (self.arrived and not self.missing()):
            return False  # decided, or everyone is here: nothing more to read
        mono = time.monotonic()
        if force_read or mono - self._read_at >= POLL_S:
            self._read_at = mono
            self._read()
        if not self.arrived or not self.missing():
            return False
        # A rank that failed by itself before arriving has its own record, which says more.
        failed = {f.rank for f in read_failures(self.failure_dir)}
        first_rank, first_at = min(self.arrived.items(), key=lambda kv: (kv[1], kv[0]))
        deadline = first_at + self.timeout_s
        if (time.time() if wall_now is None else wall_now) < deadline:
            return False
        self.declared = [r for r in self.missing() if r not in failed]
        for rank in self.declared:
            write_failure(self.failure_dir, RankFailure(
                rank, self.rank_hosts[rank], 1, deadline,
                detail=f"did not reach {self.stage} (hvd.init()) within HOROVOD_START_TIMEOUT="
                       f"{self.timeout_s:g} s after rank {first_rank} did (still starting, "
                       "stuck before hvd.init(), or ended without calling it)"))
        return bool(self.declared)


def watch_start(env: Mapping[str, str], failure_dir: str, rank_hosts: Mapping[int, str],
                stage: str) -> Optional[StartWatch]:
    """The watch for a job whose ranks get ``env``; None when it has no start timeout."""
    timeout = start_timeout(env)
    return StartWatch(failure_dir, rank_hosts, timeout, stage) if timeout else None
