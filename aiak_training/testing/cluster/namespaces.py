"""The run's name prefix (claimed with a lock file), finding this run's namespaces and links,
leftovers of dead runs, destroying everything a run created, and :func:`can_emulate` (which
tries creating a namespace)."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Callable, Mapping, Sequence

from aiak_training.testing.cluster.constants import (IFACE_NAME, LOCK_DIR, NAME_STEM, PREFIX_RE,
                                                     ClusterError)
from aiak_training.testing.cluster.requirements import static_requirements, tool_paths


def _proc_start_time(pid: int) -> str | None:
    """Start time of a live process (clock ticks since boot), None if gone or a zombie.

    The start time tells a live owner from an unrelated process that reuses its pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        fields = stat.rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except (OSError, IndexError):
        return None


def _owner_alive(info: Mapping[str, object]) -> bool:
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    start = _proc_start_time(pid)
    return start is not None and info.get("start") in (None, start)


def _lock_dir() -> str:
    os.makedirs(LOCK_DIR, mode=0o755, exist_ok=True)
    return LOCK_DIR


def run_quiet(args: Sequence[str], timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def list_netns() -> list[str]:
    tools, _ = tool_paths()
    out = run_quiet([tools["ip"], "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links(netns: str | None = None) -> list[str]:
    tools, _ = tool_paths()
    cmd = [tools["ip"]] + (["-n", netns] if netns else []) + ["-o", "link", "show"]
    out = run_quiet(cmd).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _owned(names: Sequence[str], prefix: str) -> list[str]:
    """Names that belong to ``prefix``: exactly prefix + (n<i> | v<i> | br | sw)."""
    pat = re.compile(rf"^{re.escape(prefix)}(?:n\d+|v\d+|br|sw)$")
    return [n for n in names if pat.match(n)]


def _prefix_in_use(prefix: str) -> bool:
    stem = re.compile(rf"^{re.escape(prefix)}\D")
    return any(stem.match(n) for n in list_netns() + list_links())


def claim_prefix(requested: str | None = None) -> str:
    """Atomically claim a free ``aiakNNN`` prefix with an O_EXCL lock file.

    The first candidate is based on the pid, so concurrent runs usually differ at once; any
    prefix with a lock file or with existing namespaces/links (leftovers of a crash) is skipped.
    """
    lock_dir = _lock_dir()
    if requested is not None:
        if not PREFIX_RE.match(requested):
            raise ValueError(f"prefix must look like 'aiak123', got {requested!r}")
        candidates = [int(requested[len(NAME_STEM):])]
    else:
        base = os.getpid() % 1000
        candidates = [(base + k) % 1000 for k in range(1000)]
    info = json.dumps({"pid": os.getpid(), "start": _proc_start_time(os.getpid())})
    for number in candidates:
        prefix = f"{NAME_STEM}{number:03d}"
        path = os.path.join(lock_dir, prefix + ".lock")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(info)
        if _prefix_in_use(prefix):  # leftovers without a lock: never reuse their names
            os.unlink(path)
            continue
        return prefix
    raise ClusterError(f"no free aiakNNN prefix (see {lock_dir}; try --cleanup-stale)")


def release_prefix(prefix: str) -> None:
    try:
        os.unlink(os.path.join(LOCK_DIR, prefix + ".lock"))
    except FileNotFoundError:
        pass


def kill_netns_processes(namespaces: Sequence[str], grace: float = 2.0,
                          keep: Callable[[], set[int]] | None = None) -> None:
    """SIGTERM, then SIGKILL, every process whose network namespace is one of ``namespaces``.

    Namespaces cannot really be deleted while processes hold them (the veth inside would live
    on), and stray MPI ranks would keep burning the shared CPUs.  ``keep()`` names processes
    of the tool itself that must survive (the ``tc`` behind a running jitter emulation).
    """
    tools, _ = tool_paths()

    def pids() -> set[int]:
        found: set[int] = set()
        for ns in namespaces:
            r = run_quiet([tools["ip"], "netns", "pids", ns])
            found.update(int(p) for p in r.stdout.split() if p.isdigit())
        found.discard(os.getpid())
        return found - (keep() if keep else set())

    for sig in (signal.SIGTERM, signal.SIGKILL):
        victims = pids()
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and pids():
            time.sleep(0.05)


def destroy(prefix: str, log: Callable[[str], None] | None) -> list[str]:
    """Remove everything named with ``prefix``; returns what could not be removed.

    Order: processes in the namespaces, veths (which take their peers along), bridges, then
    the namespaces.  Every step is best-effort so one failure cannot leave the rest behind.
    """
    tools, _ = tool_paths()
    namespaces = _owned(list_netns(), prefix)
    kill_netns_processes(namespaces)
    # Links live in the switch namespace; the root namespace is swept as well so that
    # nothing carrying this (claimed, hence ours) prefix can survive anywhere.
    for netns in [ns for ns in namespaces if ns.endswith("sw")] + [None]:
        where = ["-n", netns] if netns else []
        for name in sorted(_owned(list_links(netns), prefix), key=lambda n: n.endswith("br")):
            run_quiet([tools["ip"], *where, "link", "del", name])
    for ns in namespaces:
        run_quiet([tools["ip"], "netns", "del", ns])
    for tmp in _glob_tmpdirs(prefix):
        shutil.rmtree(tmp, ignore_errors=True)
    left = _owned(list_netns(), prefix) + _owned(list_links(), prefix)
    if left and log:
        log(f"WARNING: could not remove {', '.join(left)}")
    return left


def leftovers(prefix: str) -> list[str]:
    """What is left of run ``prefix``: its namespaces, links in the root namespace, its lock
    file, and processes still inside its namespaces (as ``pid <n> in <namespace>``).

    Empty after a clean teardown; tests assert exactly that.
    """
    found = _owned(list_netns(), prefix) + _owned(list_links(), prefix)
    tools, _ = tool_paths()
    for ns in _owned(list_netns(), prefix):
        r = run_quiet([tools["ip"], "netns", "pids", ns])
        found += [f"pid {p} in {ns}" for p in r.stdout.split() if p.isdigit()]
    if os.path.exists(os.path.join(LOCK_DIR, prefix + ".lock")):
        found.append(prefix + ".lock")
    return found


def _glob_tmpdirs(prefix: str) -> list[str]:
    base = tempfile.gettempdir()
    try:
        return [os.path.join(base, d) for d in os.listdir(base)
                if d.startswith(f"aiak_cluster_{prefix}_")]
    except OSError:
        return []


def cleanup_stale(log: Callable[[str], None] | None = None) -> list[str]:
    """Remove the resources of runs whose owner process is gone (e.g. killed with SIGKILL).

    Only prefixes with a lock file written by this tool whose owner is dead are touched, so
    live parallel runs and anything not created by this tool are left alone.
    Returns the cleaned prefixes.
    """
    if os.geteuid() != 0 or not os.path.isdir(LOCK_DIR):
        return []
    cleaned = []
    for entry in sorted(os.listdir(LOCK_DIR)):
        prefix = entry[:-len(".lock")] if entry.endswith(".lock") else ""
        if not PREFIX_RE.match(prefix):
            continue
        path = os.path.join(LOCK_DIR, entry)
        try:
            with open(path) as f:
                info = json.load(f)
        except (OSError, ValueError):
            # A lock being written right now reads as empty; only a clearly old one is stale.
            try:
                if time.time() - os.path.getmtime(path) < 60:
                    continue
            except OSError:
                continue
            info = {}
        if _owner_alive(info):
            continue
        if log:
            log(f"removing leftovers of dead run {prefix} (pid {info.get('pid')})")
        destroy(prefix, log)
        release_prefix(prefix)
        cleaned.append(prefix)
    return cleaned


#: What can_emulate's trial found, cached for the life of the process.
_TRIAL_RESULT: tuple[bool, str] | None = None


def can_emulate(try_it: bool = True) -> tuple[bool, str]:
    """Whether a cluster can be emulated here, and why not (or a short "ok" note).

    Checks root and the tools; with ``try_it`` also creates (and removes) a namespace, a veth
    pair with a tbf qdisc and a bridge, and tries ``unshare --uts``, because containers often
    have the tools but not the capabilities.  The trial's result is cached per process.
    """
    global _TRIAL_RESULT
    reason = static_requirements()
    if reason:
        return False, reason
    if not try_it:
        return True, "root and tools present (not tried)"
    if _TRIAL_RESULT is not None:
        return _TRIAL_RESULT
    tools, _ = tool_paths()
    try:
        r = subprocess.run([tools["unshare"], "--uts", "true"], capture_output=True, text=True,
                           timeout=10)
        if r.returncode != 0:
            _TRIAL_RESULT = (False, f"'unshare --uts' failed: {r.stderr.strip()}")
            return _TRIAL_RESULT
        prefix = claim_prefix()
        try:
            ns, sw, veth, br = f"{prefix}n0", f"{prefix}sw", f"{prefix}v0", f"{prefix}br"
            ip, tc = tools["ip"], tools["tc"]
            steps = [
                [ip, "netns", "add", sw],
                [ip, "netns", "add", ns],
                [ip, "-n", sw, "link", "add", br, "type", "bridge"],
                [ip, "-n", sw, "link", "add", veth, "type", "veth", "peer", "name", IFACE_NAME,
                 "netns", ns],
                [ip, "-n", sw, "link", "set", veth, "master", br],
                [tc, "-n", ns, "qdisc", "add", "dev", IFACE_NAME, "root", "tbf", "rate", "1gbit",
                 "burst", "262144", "latency", "50ms"],
            ]
            for step in steps:
                r = subprocess.run(step, capture_output=True, text=True, timeout=10)
                if r.returncode != 0:
                    _TRIAL_RESULT = (False, f"'{shlex.join(step)}' failed: "
                                            f"{r.stderr.strip() or r.returncode}")
                    return _TRIAL_RESULT
        finally:
            destroy(prefix, log=None)
            release_prefix(prefix)
    except (OSError, subprocess.SubprocessError, ClusterError) as exc:
        _TRIAL_RESULT = (False, f"namespace trial failed: {exc}")
        return _TRIAL_RESULT
    _TRIAL_RESULT = (True, "root, ip/tc/unshare present, netns+veth+bridge+tbf work")
    return _TRIAL_RESULT
