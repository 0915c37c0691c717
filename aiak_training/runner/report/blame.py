"""Name the rank that caused a failure, not the first one that exited.

The first rank to exit abnormally is often a victim: when one rank's program ends early (it
ran fewer steps than the others, a common bug with uneven data), its ``hvd.shutdown()`` makes
every other rank's next collective fail with ``HorovodInternalError``, and those ranks exit
non-zero while the early one ends cleanly.  After a stall shutdown the failing ranks are the
ones that waited, and the culprit is the rank that never submitted.

The runtime leaves notes beside the failure records (``common/job/exit_guard.py``): ``finished``
(the program called ``hvd.shutdown()`` while its engine ran) and ``error`` (the first
``HorovodInternalError``, with the ranks a stall report named as missing).  This module reads
them and, where they show the cause, writes the summary's first line about that rank.  Where
they are not visible (a remote host without a shared file system) or show nothing, the
summary stays as before.  Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from aiak_training.common.job.records import RankFailure, read_records

# Reasons the engine appends to Horovod's shut-down message (csrc/engine/controller.cpp).
PEER_SHUTDOWN = "another rank shut down"
STALL_SHUTDOWN = "stalled tensors exceeded HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
UNEVEN_HINT = ("the ranks ran different numbers of steps? Every rank must make the same "
               "collective calls: give each rank the same number of batches")


@dataclass(frozen=True)
class Note:
    """One ``*.note`` record of a rank."""

    rank: Optional[int]
    host: str
    event: str                 # "finished" or "error"
    time: float
    message: str = ""
    missing: Dict[int, List[str]] = field(default_factory=dict)


def read_notes(directory: str) -> List[Note]:
    """Every readable note in ``directory``, earliest first."""
    return read_records(directory, ".note", lambda raw: Note(
        raw.get("rank"), str(raw.get("host", "?")), str(raw["event"]),
        float(raw.get("time", 0.0)), str(raw.get("message", "")),
        {int(r): list(n) for r, n in (raw.get("missing") or {}).items()}))


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(set(ranks))
    return (f"rank {ranks[0]}" if len(ranks) == 1
            else "ranks " + ", ".join(str(r) for r in ranks))


def _with_hosts(ranks: Sequence[int], hosts: Dict[int, str]) -> str:
    """``rank 1 (host a)`` / ``ranks 1, 2 (hosts a, b)``; hosts left out where unknown."""
    ranks = sorted(set(ranks))
    known = list(dict.fromkeys(hosts[r] for r in ranks if r in hosts))
    if not known:
        return _ranks_text(ranks)
    return f"{_ranks_text(ranks)} (host{'s' if len(known) > 1 else ''} {', '.join(known)})"


def culprit_line(failures: Sequence[RankFailure], notes: Sequence[Note],
                 rank_hosts: Optional[Dict[int, str]] = None) -> Optional[str]:
    """The summary's first line (after ``job failed: ``) when the notes show which rank
    caused the failure; None when they do not (the first failure is then the cause)."""
    if not failures:
        return None
    hosts: Dict[int, str] = dict(rank_hosts or {})
    for item in list(notes) + list(failures):
        if item.rank is not None:
            hosts[item.rank] = item.host
    errors = {n.rank: n for n in notes if n.event == "error" and n.rank is not None}
    failed = [f.rank for f in failures if f.rank is not None]

    # A stall shutdown: the waiting ranks failed; the ranks the report named did not submit.
    # Only the coordinator (rank 0) sees the report, and only the ranks whose own wait had
    # passed the limit name the stall in their error (the others read "another rank shut
    # down"), so the two are combined over all notes.
    missing: Dict[int, List[str]] = {}
    for note in errors.values():
        for r, names in note.missing.items():
            missing.setdefault(r, []).extend(n for n in names if n not in missing.get(r, []))
    if missing and any(STALL_SHUTDOWN in n.message for n in errors.values()):
        tensors = sorted({n for names in missing.values() for n in names})
        shown = ", ".join(tensors[:3]) + (f" and {len(tensors) - 3} more"
                                          if len(tensors) > 3 else "")
        waited = sorted(r for r in errors if r not in missing)
        return (f"{_with_hosts(list(missing), hosts)} did not submit {shown}, which "
                f"{_ranks_text(waited) if waited else 'the other ranks'} waited for until "
                "the stall check shut the job down (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")

    # A rank's program ended while others still waited in a collective.
    first = failures[0]
    note = errors.get(first.rank)
    if note is not None and PEER_SHUTDOWN in note.message:
        finished = [n.rank for n in notes if n.event == "finished" and n.rank is not None
                    and n.rank not in errors and n.rank not in failed]
        if finished:
            waiting = sorted(r for r, n in errors.items() if PEER_SHUTDOWN in n.message)
            return (f"{_with_hosts(finished, hosts)} ended (the program called "
                    f"hvd.shutdown()) while {_ranks_text(waiting)} still waited in a "
                    f"collective; {UNEVEN_HINT}")
    return None
