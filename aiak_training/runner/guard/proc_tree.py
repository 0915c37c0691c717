"""Finding and killing a job's processes on Linux (via /proc), without psutil.

MPICH's hydra proxies put every rank in its own session, so killing the launcher's process
group misses them; walking the parent links in /proc finds them all.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Dict, Iterable, List, Set

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = None


def _prctl(option: int, arg: int) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def term_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when its parent dies, however it dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def set_child_subreaper() -> bool:
    """Become the parent of orphaned descendants, so none escapes when the launcher dies."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _parent_map() -> Dict[int, int]:
    parents: Dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return parents
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: fields start after the last ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            parents[int(entry)] = int(fields[1])
    return parents


def children(pid: int) -> List[int]:
    """Direct children of ``pid``."""
    return [p for p, ppid in _parent_map().items() if ppid == pid]


def descendants(pid: int) -> List[int]:
    """All descendants of ``pid`` (children first), not including ``pid``."""
    by_parent: Dict[int, List[int]] = {}
    for p, ppid in _parent_map().items():
        by_parent.setdefault(ppid, []).append(p)
    found: List[int] = []
    todo = list(by_parent.get(pid, []))
    seen: Set[int] = set()
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.add(p)
        found.append(p)
        todo.extend(by_parent.get(p, []))
    return found


def kill_all(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every pid, ignoring those already gone."""
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] != b"Z"


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (nothing is reaped)."""
    return _alive(pid)


def reap(pids: Iterable[int]) -> None:
    """Collect those of ``pids`` that are our exited children (orphans adopted as subreaper).

    Only the given pids are waited for, so children of a host program that runs aiakrun
    in-process keep their exit status.
    """
    for p in pids:
        try:
            os.waitpid(p, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def wait_gone(pids: Iterable[int], timeout: float) -> List[int]:
    """Wait until every pid has exited (reaping our own); returns those still alive."""
    pending = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        reap(pending)
        pending = [p for p in pending if _alive(p)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.02)
