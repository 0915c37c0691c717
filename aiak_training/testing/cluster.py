"""Emulate a multi-node cluster with a slow network on one Linux machine.

Layout (one run, ``P`` = a per-run prefix such as ``aiak042``)::

    switch:   namespace Psw holding bridge Pbr and the switch-side veth ends Pv0, Pv1, ...
    node i:   namespace Pn<i>, interface ``aiak0`` = 192.0.2.<i+1>/24 (peer of Pv<i>),
              hostname Pn<i> (set in a UTS namespace for each launched process)
    root:     nothing but the namespace names; no interface, address or route of ours

* Both ends of every veth get a ``tc tbf`` qdisc at the link rate: tbf only shapes egress,
  so the node end caps what a node sends and the switch end what it receives, like a
  full-duplex NIC.  Traffic between ranks of one node never leaves its namespace (loopback
  or shared memory), so it is not shaped.
* The bridge sits in a namespace of its own because bridged traffic in the root namespace
  passes its netfilter hooks (br_netfilter), which dropped the TCP SYNs between nodes here.
* Commands run inside node 0's namespace, as a job launched from a head node: the root
  namespace has no address on the emulated network (and could not connect into the
  namespaces in an earlier try), and MPICH's hydra must run where its proxies can connect
  back.
* MPICH hydra reaches the other nodes through a generated *launch agent* used in place of
  ``ssh`` (``-launcher ssh -launcher-exec <agent>``). Hydra's host names are the node IP
  addresses, so nothing has to resolve names (no /etc/hosts edits); the agent maps an address
  to its namespace and sets the node's hostname in a fresh UTS namespace, so MPI (and
  ``socket.gethostname()``) sees distinct hosts.
* Before anything runs, the tool checks the qdiscs it set and measures the real cross-node
  TCP throughput, and refuses (or warns loudly) when it is off by more than a tolerance.
* For fault tests, :meth:`EmulatedCluster.impair` adds packet loss (a classic-BPF tc filter)
  and jitter (pauses of the link's tbf, or netem where the kernel has it) to the node links,
  and :meth:`EmulatedCluster.link_down` / ``link_up`` pull and restore a node's link.
* Everything is torn down on exit, on exceptions, on SIGINT/SIGTERM/SIGHUP and at interpreter
  exit; resources are only ever found by this run's own prefix, which is claimed with a lock
  file, so parallel runs and leftovers never collide and foreign interfaces are never touched.

Command line::

    python -m aiak_training.testing.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        sh -c 'mpiexec -n 4 python bench.py'

Python::

    from aiak_training.testing.cluster import EmulatedCluster
    with EmulatedCluster(nodes=2, ranks_per_node=2, rate_gbit=1.0) as cluster:
        proc = cluster.run(cluster.mpiexec_args() + [sys.executable, "bench.py"], timeout=120)

Inside the cluster these variables are set: ``AIAK_CLUSTER_HOSTS`` (hydra ``-hosts`` value),
``AIAK_CLUSTER_LAUNCHER_EXEC``, ``AIAK_CLUSTER_IFACE``, ``AIAK_CLUSTER_NODES``,
``AIAK_CLUSTER_RANKS_PER_NODE``, ``AIAK_CLUSTER_LINK_GBIT`` (measured), plus
``AIAK_CLUSTER_NODE_NAMES``, ``AIAK_CLUSTER_PREFIX``, ``AIAK_CLUSTER_MPIEXEC``, the MPICH
transport settings of :data:`MPI_TRANSPORT_ENV`, and ``HYDRA_*`` defaults so that a plain
``mpiexec -n 4 ...`` also spreads its ranks over the emulated nodes.

Requirements: Linux, root, ``ip`` and ``tc`` (iproute2), ``unshare`` and ``hostname``.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import math
import os
import pty
import random
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tty
import warnings
from typing import Callable, Mapping, Sequence

from aiak_training.testing import launch_agent

__all__ = [
    "ClusterError",
    "ClusterUnavailable",
    "EmulatedCluster",
    "LinkRateMismatch",
    "MPI_TRANSPORT_ENV",
    "can_emulate",
    "cleanup_stale",
    "leftovers",
    "link_command",
    "loss_bytecode",
    "loss_commands",
    "main",
    "mpiexec_args",
    "netem_commands",
    "parse_rate",
    "parse_size",
    "restore_child_command",
    "tbf_burst_bytes",
    "tbf_change_line",
    "tbf_limit_bytes",
    "tbf_pause_line",
]

#: Name of the node-side interface, identical in every namespace so one ``-iface`` fits all.
IFACE_NAME = "aiak0"
#: TEST-NET-1 (RFC 5737): reserved for documentation, never routed, so it cannot clash with a
#: real network; only ever assigned to interfaces this module creates.
SUBNET = "192.0.2."
MAX_NODES = 250
#: Names are ``aiak<3 digits>`` + suffix; 3 digits keep every name within IFNAMSIZ (15).
NAME_STEM = "aiak"
PREFIX_RE = re.compile(r"^aiak\d{3}$")
#: Lock files that claim a prefix; /run is a tmpfs, cleared (like the namespaces) at boot.
LOCK_DIR = "/run/aiak_cluster"
#: TCP port of the link-rate probe; it only listens inside this run's node-1 namespace.
PROBE_PORT = 47001

#: Environment that makes this MPICH wheel (ch4, netmods ucx and ofi; ucx is the default)
#: carry inter-node traffic over TCP on the emulated links.  Without it, UCX picks its
#: shared-memory transports between "nodes" (the namespaces share /dev/shm and the kernel),
#: which measured 8.8 GB/s across a 1 Gbit/s link: the shaping is silently bypassed.
#: ofi+tcp is the default here; the UCX_* entries make ``MPIR_CVAR_CH4_NETMOD=ucx`` safe too.
#: Intra-node traffic still uses MPICH's own shared memory.
MPI_TRANSPORT_ENV: dict[str, str] = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": IFACE_NAME,
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": IFACE_NAME,
}

_ENV_KEYS = (
    "AIAK_CLUSTER_HOSTS",
    "AIAK_CLUSTER_LAUNCHER_EXEC",
    "AIAK_CLUSTER_IFACE",
    "AIAK_CLUSTER_NODES",
    "AIAK_CLUSTER_RANKS_PER_NODE",
    "AIAK_CLUSTER_LINK_GBIT",
)


class ClusterError(RuntimeError):
    """Setting up, verifying or running the emulated cluster failed."""


class ClusterUnavailable(ClusterError):
    """This machine or user cannot emulate a cluster (not root, tools missing, no netns)."""


class LinkRateMismatch(ClusterError):
    """The measured cross-node throughput is too far from the requested link rate."""


# --------------------------------------------------------------------------------------------
# Rates


_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*?)(?:/s|ps)?\s*$", re.I)
# Multipliers to Gbit/s.  Bit units only, as in tc(8); tc's "bps" family means *bytes* per
# second, which is a classic source of 8x mistakes, so those are rejected below.
_RATE_UNITS = {
    "bit": 1e-9,
    "kbit": 1e-6,
    "mbit": 1e-3,
    "gbit": 1.0,
    "tbit": 1e3,
    "kibit": 1024 / 1e9,
    "mibit": 1024**2 / 1e9,
    "gibit": 1024**3 / 1e9,
    "tibit": 1024**4 / 1e9,
}


def parse_rate(text: str | float | int) -> float:
    """Parse a link rate such as ``"1gbit"``, ``"500mbit"``, ``"5Gbit/s"`` into Gbit/s.

    A bare number is taken as Gbit/s.  Byte-based units (``"mbps"``, ``"MB"``) are refused,
    because tc reads ``mbps`` as megaBYTES per second.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        raw = text.strip()
        if re.search(r"(bps|b/s|byte)$", raw, re.I) or re.search(r"[0-9\s][kKmMgGtT]?i?B$", raw):
            raise ValueError(f"rate {text!r}: use bit units such as '1gbit' or '500mbit' "
                             "(tc reads 'bps' as bytes per second)")
        m = _RATE_RE.match(raw)
        if not m:
            raise ValueError(f"cannot parse rate {text!r}; expected e.g. '1gbit', '500mbit'")
        number, unit = m.group(1), m.group(2).lower()
        if unit == "":
            mult = 1.0
        elif unit in _RATE_UNITS:
            mult = _RATE_UNITS[unit]
        elif unit + "bit" in _RATE_UNITS:  # "1g", "500m"
            mult = _RATE_UNITS[unit + "bit"]
        else:
            raise ValueError(f"rate {text!r}: unknown unit {unit!r}; use bit/kbit/mbit/gbit/tbit")
        value = float(number) * mult
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"rate must be a positive number of Gbit/s, got {text!r}")
    return value


def tbf_burst_bytes(rate_gbit: float) -> int:
    """tbf bucket size for a rate: 0.5 ms of traffic, clamped to [256 KiB, 4 MiB].

    With GSO/TSO a veth hands tbf "packets" of up to 64 KiB; a bucket near that size makes
    throughput collapse, hence the floor of 4x that.  A bigger bucket is not better: after
    an idle gap a node may send a whole bucket at memory speed, which makes bursty traffic
    (ping-pong, one allreduce at a time) look faster than the link.  Measured on a 2-vCPU VM:
    256 KiB sustains 95% of 5 Gbit/s and 512 KiB 95% of 10 Gbit/s, while a 2 MiB bucket let
    an 8 MiB ping-pong run at 1.2x the 10 Gbit/s rate.
    """
    rate_bytes = rate_gbit * 1e9 / 8
    return int(min(max(rate_bytes * 0.0005, 256 * 1024), 4 * 1024 * 1024))


def _rate_arg(text: str) -> float:
    """argparse type for --rate, with parse_rate's message instead of argparse's generic one."""
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_size(text: str) -> int:
    """Parse a byte count such as ``"256kb"``, ``"1mb"``, ``"300000"`` (k, m: 1024-based, as tc)."""
    m = re.match(r"^\s*(\d+)\s*(b|k|kb|kib|m|mb|mib)?\s*$", text, re.I)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; expected e.g. '256kb', '1mb', '300000'")
    unit = (m.group(2) or "b").lower()[:1]
    return int(m.group(1)) * {"b": 1, "k": 1024, "m": 1024 * 1024}[unit]


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tc_rate(rate_gbit: float) -> str:
    """A tc rate argument in kbit (exact for any rate this tool accepts)."""
    return f"{max(1, round(rate_gbit * 1e6))}kbit"


# --------------------------------------------------------------------------------------------
# Requirements


def _tool_paths() -> tuple[dict[str, str], list[str]]:
    """Absolute paths of the external tools, and the names of the missing ones."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
    found: dict[str, str] = {}
    missing: list[str] = []
    for tool in ("ip", "tc", "unshare", "hostname"):
        path = shutil.which(tool, path=search)
        if path:
            found[tool] = path
        else:
            missing.append(tool)
    return found, missing


def _static_requirements() -> str | None:
    """Reason the tool cannot work here without trying anything, or None."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return ("emulating a cluster needs root (it creates network namespaces, veth links "
                "and tc qdiscs); re-run as root")
    _, missing = _tool_paths()
    if missing:
        return (f"required tools not found: {', '.join(missing)} "
                "(install iproute2 for ip/tc, util-linux for unshare, hostname)")
    return None


_PROBE_RESULT: tuple[bool, str] | None = None


def can_emulate(probe: bool = True) -> tuple[bool, str]:
    """Whether a cluster can be emulated here, and why not (or a short "ok" note).

    Checks root and the tools; with ``probe`` also creates (and removes) a namespace, a veth
    pair with a tbf qdisc and a bridge, and tries ``unshare --uts``, because containers often
    have the tools but not the capabilities.  The probe result is cached per process.
    """
    global _PROBE_RESULT
    reason = _static_requirements()
    if reason:
        return False, reason
    if not probe:
        return True, "root and tools present (not probed)"
    if _PROBE_RESULT is not None:
        return _PROBE_RESULT
    tools, _ = _tool_paths()
    try:
        r = subprocess.run([tools["unshare"], "--uts", "true"], capture_output=True, text=True,
                           timeout=10)
        if r.returncode != 0:
            _PROBE_RESULT = (False, f"'unshare --uts' failed: {r.stderr.strip()}")
            return _PROBE_RESULT
        prefix = _claim_prefix()
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
                    _PROBE_RESULT = (False, f"'{shlex.join(step)}' failed: "
                                            f"{r.stderr.strip() or r.returncode}")
                    return _PROBE_RESULT
        finally:
            _destroy(prefix, log=None)
            _release_prefix(prefix)
    except (OSError, subprocess.SubprocessError, ClusterError) as exc:
        _PROBE_RESULT = (False, f"namespace probe failed: {exc}")
        return _PROBE_RESULT
    _PROBE_RESULT = (True, "root, ip/tc/unshare present, netns+veth+bridge+tbf work")
    return _PROBE_RESULT


# --------------------------------------------------------------------------------------------
# Prefixes, leftovers and destruction


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


def _run_quiet(args: Sequence[str], timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def _list_netns() -> list[str]:
    tools, _ = _tool_paths()
    out = _run_quiet([tools["ip"], "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _list_links(netns: str | None = None) -> list[str]:
    tools, _ = _tool_paths()
    cmd = [tools["ip"]] + (["-n", netns] if netns else []) + ["-o", "link", "show"]
    out = _run_quiet(cmd).stdout
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
    return any(stem.match(n) for n in _list_netns() + _list_links())


def _claim_prefix(requested: str | None = None) -> str:
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


def _release_prefix(prefix: str) -> None:
    try:
        os.unlink(os.path.join(LOCK_DIR, prefix + ".lock"))
    except FileNotFoundError:
        pass


def _kill_netns_processes(namespaces: Sequence[str], grace: float = 2.0,
                          keep: Callable[[], set[int]] | None = None) -> None:
    """SIGTERM, then SIGKILL, every process whose network namespace is one of ``namespaces``.

    Namespaces cannot really be deleted while processes hold them (the veth inside would live
    on), and stray MPI ranks would keep burning the shared CPUs.  ``keep()`` names processes
    of the tool itself that must survive (the ``tc`` behind a running jitter emulation).
    """
    tools, _ = _tool_paths()

    def pids() -> set[int]:
        found: set[int] = set()
        for ns in namespaces:
            r = _run_quiet([tools["ip"], "netns", "pids", ns])
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


def _destroy(prefix: str, log: Callable[[str], None] | None) -> list[str]:
    """Remove everything named with ``prefix``; returns what could not be removed.

    Order: processes in the namespaces, veths (which take their peers along), bridges, then
    the namespaces.  Every step is best-effort so one failure cannot leave the rest behind.
    """
    tools, _ = _tool_paths()
    namespaces = _owned(_list_netns(), prefix)
    _kill_netns_processes(namespaces)
    # Links live in the switch namespace; the root namespace is swept as well so that
    # nothing carrying this (claimed, hence ours) prefix can survive anywhere.
    for netns in [ns for ns in namespaces if ns.endswith("sw")] + [None]:
        where = ["-n", netns] if netns else []
        for name in sorted(_owned(_list_links(netns), prefix), key=lambda n: n.endswith("br")):
            _run_quiet([tools["ip"], *where, "link", "del", name])
    for ns in namespaces:
        _run_quiet([tools["ip"], "netns", "del", ns])
    for tmp in _glob_tmpdirs(prefix):
        shutil.rmtree(tmp, ignore_errors=True)
    left = _owned(_list_netns(), prefix) + _owned(_list_links(), prefix)
    if left and log:
        log(f"WARNING: could not remove {', '.join(left)}")
    return left


def leftovers(prefix: str) -> list[str]:
    """What is left of run ``prefix``: its namespaces, links in the root namespace, its lock
    file, and processes still inside its namespaces (as ``pid <n> in <namespace>``).

    Empty after a clean teardown; tests assert exactly that.
    """
    found = _owned(_list_netns(), prefix) + _owned(_list_links(), prefix)
    tools, _ = _tool_paths()
    for ns in _owned(_list_netns(), prefix):
        r = _run_quiet([tools["ip"], "netns", "pids", ns])
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
        _destroy(prefix, log)
        _release_prefix(prefix)
        cleaned.append(prefix)
    return cleaned


# --------------------------------------------------------------------------------------------
# Impairments: packet loss, jitter, delay (EmulatedCluster.impair) and links going down
#
# This kernel has no netem (nor fq or cake), so loss and jitter are built from what it has:
# * loss: a classic-BPF tc filter on the egress hook of each node's interface (clsact), which
#   draws a random number per packet and drops the packet below a threshold.  An offloaded
#   (GSO) packet would be dropped as a whole 64 KiB burst, so the node interface is limited to
#   one segment per packet while loss is on (``gso_max_segs 1``).
# * jitter: each node's outgoing tbf is paused (its rate dropped to a trickle) for a random
#   0..jitter_ms at random moments, so packets sent meanwhile wait up to jitter_ms.  Where
#   netem exists, netem's ``delay D J`` is used instead (a child of the tbf), and only there
#   can a constant ``delay_ms`` be added.
# Every packet between nodes leaves through exactly one node interface, so impairing the node
# ends (egress) affects each packet once, in both directions of every connection.

#: Classic BPF "ld rand" (SKF_AD_OFF + SKF_AD_RANDOM): load a uniform random u32.
_BPF_LD_RANDOM = 0xFFFFF000 + 56
_TC_ACT_SHOT = 2               # verdict: drop
_TC_ACT_UNSPEC = 0xFFFFFFFF    # -1, no verdict: the packet goes on as if unfiltered
#: Loss above this makes TCP stall for minutes; a dead link is link_down().
MAX_LOSS_PCT = 50.0
MAX_JITTER_MS = 10_000.0
MAX_DELAY_MS = 10_000.0
#: A paused link end (tbf_pause_line).  Its buckets hold one full frame, or tbf would drop
#: full-size frames.
_PAUSED_RATE = "8kbit"
_PAUSED_PEAKRATE = "16kbit"
_PAUSED_BURST = 1600
#: The largest frame; a pause drains the refilled buckets with one frame of this size.
_FRAME_BYTES = 1514
_CLONE_NEWNET = 0x40000000
#: The "latency 50ms" of the link tbf (EmulatedCluster._tbf); it sets tbf's queue limit.
_TBF_LATENCY_S = 0.05
#: netem's queue, in packets: its default of 1000 would drop at 1 Gbit/s x 60 ms.
_NETEM_LIMIT = 100_000
#: Handle of the child qdisc put under the link tbf (netem, or a bfifo when restoring).
_CHILD_HANDLE = "a1ac:"


def _check_number(name: str, value: object, high: float) -> float:
    """``value`` as a float in [0, high], or TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or not 0 <= number <= high:
        raise ValueError(f"{name} must be between 0 and {high:g}, got {value!r}")
    return number


def loss_bytecode(loss_pct: float) -> str:
    """tc ``bpf bytecode`` (classic BPF, direct action) that drops IPv4 packets with
    probability ``loss_pct`` / 100 and leaves everything else (ARP) alone."""
    loss = _check_number("loss_pct", loss_pct, MAX_LOSS_PCT)
    threshold = min(round(loss / 100 * 2**32), 2**32 - 1)
    program = [
        (0x28, 0, 0, 12),              # ldh [12]           the EtherType
        (0x15, 0, 3, 0x0800),          # jeq #IPv4          else: pass
        (0x20, 0, 0, _BPF_LD_RANDOM),  # ld rand            uniform in [0, 2^32)
        (0x35, 1, 0, threshold),       # jge #threshold     pass, else drop
        (0x06, 0, 0, _TC_ACT_SHOT),    # ret #drop
        (0x06, 0, 0, _TC_ACT_UNSPEC),  # ret #pass
    ]
    return f"{len(program)}," + ",".join(f"{c} {jt} {jf} {k}" for c, jt, jf, k in program)


def tbf_limit_bytes(rate_gbit: float, burst_bytes: int) -> int:
    """The queue limit tc derives from ``latency 50ms``: rate x latency + burst, in bytes."""
    return int(rate_gbit * 1e9 / 8 * _TBF_LATENCY_S) + burst_bytes


def tbf_change_line(dev: str, rate: str, burst: int, limit: int) -> str:
    """A ``tc -batch`` line that changes the root tbf of ``dev`` in place.  The limit stays
    the same in both states of a pause, so the queued packets are kept, not flushed."""
    return f"qdisc change dev {dev} root tbf rate {rate} burst {burst} limit {limit}"


def tbf_pause_line(dev: str, limit: int) -> str:
    """The ``tc -batch`` line that pauses a link end: a trickle of 1 byte per ms (a small
    packet waits tens of ms, a full frame 1.5 s).  The peak bucket of one frame keeps the
    refilled bucket from letting a burst of small packets through; the next
    :func:`tbf_change_line`, which has no peak rate, lifts the pause."""
    return (f"{tbf_change_line(dev, _PAUSED_RATE, _PAUSED_BURST, limit)} "
            f"peakrate {_PAUSED_PEAKRATE} mtu {_PAUSED_BURST}")


def _socket_in_netns(netns: str) -> socket.socket:
    """A UDP socket (broadcast allowed) that lives in network namespace ``netns``.

    setns() moves only the calling thread, so a short-lived thread enters the namespace,
    creates the socket and ends; the socket stays in that namespace wherever it is used.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    result: dict[str, object] = {}

    def enter_and_create() -> None:
        try:
            target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        except OSError as exc:
            result["error"] = exc
            return
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                result["error"] = OSError(err, f"setns({netns}): {os.strerror(err)}")
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            result["sock"] = sock
        finally:
            os.close(target)

    thread = threading.Thread(target=enter_and_create, name="aiak-cluster-netns")
    thread.start()
    thread.join()
    if "sock" not in result:
        raise ClusterError(f"cannot open a socket in {netns}: {result.get('error')}")
    return result["sock"]  # type: ignore[return-value]


def loss_commands(tc: str, netns: str, dev: str, loss_pct: float) -> list[list[str]]:
    """tc commands that make ``dev`` in ``netns`` drop outgoing IPv4 packets at random."""
    return [[tc, "-n", netns, "qdisc", "add", "dev", dev, "clsact"],
            [tc, "-n", netns, "filter", "add", "dev", dev, "egress", "pref", "1", "bpf", "da",
             "bytecode", loss_bytecode(loss_pct)]]


def netem_commands(tc: str, netns: str, dev: str, tbf_handle: str, delay_ms: float,
                   jitter_ms: float) -> list[list[str]]:
    """tc command that puts netem (``delay D [J]``) under the link tbf of ``dev``."""
    delay = _check_number("delay_ms", delay_ms, MAX_DELAY_MS)
    jitter = _check_number("jitter_ms", jitter_ms, MAX_JITTER_MS)
    args = [tc, "-n", netns, "qdisc", "replace", "dev", dev, "parent", f"{tbf_handle}1",
            "handle", _CHILD_HANDLE, "netem", "limit", str(_NETEM_LIMIT), "delay", f"{delay:g}ms"]
    if jitter:
        args.append(f"{jitter:g}ms")
    return [args]


def restore_child_command(tc: str, netns: str, dev: str, tbf_handle: str,
                          limit: int) -> list[str]:
    """Put the plain byte FIFO back under the link tbf (deleting the child instead would leave
    tbf with a qdisc that drops everything)."""
    return [tc, "-n", netns, "qdisc", "replace", "dev", dev, "parent", f"{tbf_handle}1",
            "handle", _CHILD_HANDLE, "bfifo", "limit", str(limit)]


def link_command(ip: str, netns: str, dev: str, up: bool) -> list[str]:
    """``ip`` command that takes a node's link down or brings it back up."""
    return [ip, "-n", netns, "link", "set", "dev", dev, "up" if up else "down"]


class _LinkStaller:
    """Jitter without netem: pauses one node's outgoing link for a random 0..jitter_ms, at
    random moments (gaps of 1 to 3 times jitter_ms, so a link is paused about a fifth of the
    time).  Packets sent during a pause queue up and leave when it ends.

    One long-lived ``tc -batch`` per link end takes the changes, so a pause costs a pipe
    write, not a process start.  A change refills tbf's buckets and does not wake tbf: tbf's
    timer stays armed for when the head packet could leave at the paused rate, up to 1.5 s
    later.  So each change is followed by a broadcast datagram from inside the node, once tc
    has applied it: a full frame right after pausing drains the refilled buckets, and a tiny
    one right after resuming makes tbf send its queue at once.  tc confirms a change by
    answering the ``qdisc show`` that follows it; its output goes to a pseudo-terminal, where
    it is line-buffered.
    """

    def __init__(self, tc: str, netns: str, dev: str, normal: str, paused: str,
                 jitter_ms: float, seed: int, errors_path: str, broadcast: str):
        self._normal, self._paused = normal, paused
        # Not "show ... root": in batch mode tc keeps "root" from the earlier change and exits
        # with "parent is already specified".
        self._confirm = f"qdisc show dev {dev}"
        self._jitter_s = jitter_ms / 1000.0
        self._rng = random.Random(seed)
        self._errors_path = errors_path
        self._kick_to = (broadcast, 9)  # the discard port: receivers drop it silently
        self._kick = _socket_in_netns(netns)
        self._drain = bytes(_FRAME_BYTES - 42)  # 42 = Ethernet + IPv4 + UDP headers
        self._out, tty_end = pty.openpty()
        tty.setraw(self._out)
        try:
            with open(errors_path, "w") as errors:
                self.proc = subprocess.Popen([tc, "-n", netns, "-force", "-batch", "-"],
                                             stdin=subprocess.PIPE, stdout=tty_end,
                                             stderr=errors, text=True)
        except BaseException:
            os.close(self._out)
            self._kick.close()
            raise
        finally:
            os.close(tty_end)
        self.pauses = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="aiak-cluster-jitter",
                                        daemon=True)
        self._thread.start()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _change(self, line: str, kick: bytes) -> None:
        self._send(f"{line}\n{self._confirm}")
        # Wait for tc's answer to the show (its tbf line): the change before it is in force.
        pending = b""
        deadline = time.monotonic() + 5
        while not re.search(rb"qdisc tbf [^\n]*\n", pending):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise OSError("tc did not confirm a qdisc change in 5 s")
            chunk = os.read(self._out, 4096)
            if not chunk:
                raise OSError("tc exited")
            pending += chunk
        try:
            self._kick.sendto(kick, self._kick_to)
        except OSError:  # e.g. the link is down meanwhile: nothing to wake
            pass

    def _loop(self) -> None:
        j = self._jitter_s
        try:
            while not self._stop.wait(self._rng.uniform(j, 3 * j)):
                self._change(self._paused, self._drain)
                self.pauses += 1
                self._stop.wait(self._rng.uniform(0, j))
                self._change(self._normal, b"\0")
        except (OSError, ValueError):  # tc went away (teardown): nothing left to pause
            return

    def stop(self) -> str:
        """Stop pausing, leave the link at its normal rate; returns tc's error output."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._change(self._normal, b"\0")
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._kick.close()
        os.close(self._out)
        try:
            with open(self._errors_path) as f:
                return f.read().strip()
        except OSError:
            return ""


# --------------------------------------------------------------------------------------------
# Programs run inside the namespaces: the launch agent (launch_agent.py) and the link probe
# (link_probe.py), both next to this file and run by path with an isolated interpreter.

_HERE = os.path.dirname(os.path.abspath(__file__))
_AGENT_PROGRAM = os.path.join(_HERE, "launch_agent.py")
_PROBE_PROGRAM = os.path.join(_HERE, "link_probe.py")

# `sh -c` wrapper that sets the node hostname in a fresh UTS namespace, then execs the command.
_HOSTNAME_EXEC = '"$2" "$1" || exit 125; shift 2; exec "$@"'


# --------------------------------------------------------------------------------------------
# The cluster


def _default_log(message: str) -> None:
    print(f"[aiak-cluster] {message}", file=sys.stderr, flush=True)


def _find_mpiexec() -> str | None:
    """MPICH's mpiexec next to the running interpreter first (a pyenv shim is a slow script)."""
    here = os.path.dirname(os.path.realpath(sys.executable))
    for name in ("mpiexec.hydra", "mpiexec"):
        path = os.path.join(here, name)
        if os.access(path, os.X_OK):
            return path
    return shutil.which("mpiexec")


class EmulatedCluster:
    """``nodes`` x ``ranks_per_node`` emulated cluster joined by links of ``rate_gbit``.

    Use as a context manager (or call :meth:`start` / :meth:`teardown`).  After start:

    * ``hosts``: hydra host names (node IP addresses), ``host_spec``: ``"ip:L,ip:L"``;
    * ``node_names``: hostnames the ranks see, ``namespaces``: namespace names;
    * ``measured_gbit``: measured node0 -> node1 TCP goodput (None with one node or
      ``verify="off"``); ``env``: the variables set for commands.

    ``verify``: ``"require"`` raises :class:`LinkRateMismatch` when the measured rate is off
    by more than ``tolerance`` (relative), ``"warn"`` (default) prints a loud warning,
    ``"off"`` skips the measurement (the qdisc settings are still checked).
    """

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int,
        rate_gbit: float | str,
        *,
        verify: str = "warn",
        tolerance: float = 0.2,
        measure_seconds: float = 1.0,
        prefix: str | None = None,
        handle_signals: bool = True,
        burst_bytes: int | None = None,
        mpi_env: Mapping[str, str] | None = None,
        hydra_env: bool = True,
        log: Callable[[str], None] | None = _default_log,
    ) -> None:
        if not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be an integer in 1..{MAX_NODES}, got {nodes!r}")
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if verify not in ("require", "warn", "off"):
            raise ValueError(f"verify must be 'require', 'warn' or 'off', got {verify!r}")
        if not 0 < tolerance < 1:
            raise ValueError(f"tolerance must be in (0, 1), got {tolerance!r}")
        if not 0.1 <= measure_seconds <= 30:
            raise ValueError(f"measure_seconds must be in [0.1, 30], got {measure_seconds!r}")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.rate_gbit = parse_rate(rate_gbit)
        self.burst_bytes = tbf_burst_bytes(self.rate_gbit) if burst_bytes is None else burst_bytes
        if self.burst_bytes < 64 * 1024:
            raise ValueError("burst_bytes must be at least 64 KiB (one GSO segment), "
                             f"got {self.burst_bytes}")
        self.verify = verify
        self.tolerance = tolerance
        self.measure_seconds = measure_seconds
        self.mpi_env = dict(MPI_TRANSPORT_ENV if mpi_env is None else mpi_env)
        self.hydra_env = hydra_env
        self._requested_prefix = prefix
        self._handle_signals = handle_signals
        self._log_fn = log
        self.prefix: str | None = None
        self.measured_gbit: float | None = None
        self.link_report: dict[str, object] = {}
        self.env: dict[str, str] = {}
        self._tmpdir: str | None = None
        self._agent: str | None = None
        self._tools: dict[str, str] = {}
        self._started = False
        self._torn_down = False
        self._prev_handlers: dict[int, object] = {}
        self._lock = threading.Lock()
        # Impairments (see impair()): what is applied, and what must be undone.
        self._impairment: dict[str, object] = {}
        self._stallers: list[_LinkStaller] = []
        self._gso_segs: dict[int, str] = {}       # node -> gso_max_segs before impair()
        self._netem_nodes: dict[int, str] = {}    # node -> tbf handle with netem under it
        self._loss_nodes: list[int] = []
        self._links_down: set[int] = set()
        self._netem: bool | None = None

    # -- names ------------------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        return [f"{self.prefix}n{i}" for i in range(self.nodes)]

    @property
    def node_names(self) -> list[str]:
        """Hostnames the ranks of each node see (the namespace names: unique per run)."""
        return self.namespaces

    @property
    def addresses(self) -> list[str]:
        return [f"{SUBNET}{i + 1}" for i in range(self.nodes)]

    @property
    def hosts(self) -> list[str]:
        """Host names hydra must be given: the node addresses (resolvable without DNS)."""
        return self.addresses

    @property
    def host_spec(self) -> str:
        return ",".join(f"{h}:{self.ranks_per_node}" for h in self.hosts)

    @property
    def switch_namespace(self) -> str:
        """Namespace that holds the bridge (the emulated switch) and the switch-side veths."""
        return f"{self.prefix}sw"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def agent_path(self) -> str | None:
        return self._agent

    def _veth(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def __repr__(self) -> str:
        return (f"EmulatedCluster(nodes={self.nodes}, ranks_per_node={self.ranks_per_node}, "
                f"rate_gbit={self.rate_gbit:g}, prefix={self.prefix!r}, "
                f"measured_gbit={self.measured_gbit!r})")

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _log(self, message: str) -> None:
        if self._log_fn is not None:
            self._log_fn(message)

    def start(self) -> "EmulatedCluster":
        """Create namespaces, links and shaping, verify the link rate; tear down on failure."""
        if self._started:
            return self
        if self._torn_down:
            raise ClusterError("an EmulatedCluster cannot be restarted after teardown")
        reason = _static_requirements()
        if reason:
            raise ClusterUnavailable(reason)
        self._tools, _ = _tool_paths()
        self._started = True
        # Handlers and atexit go in first, so an interrupt during setup still cleans up.
        self._install_signal_handlers()
        atexit.register(self.teardown)
        try:
            cleanup_stale(self._log)
            self.prefix = _claim_prefix(self._requested_prefix)
            self._tmpdir = tempfile.mkdtemp(prefix=f"aiak_cluster_{self.prefix}_")
            self._log(f"{self.prefix}: creating {self.nodes} node(s) x {self.ranks_per_node} "
                      f"rank(s), "
                      f"link {self.rate_gbit:g} Gbit/s (tbf burst "
                      f"{self.burst_bytes} B)")
            self._create_network()
            self._write_agent()
            self._check_qdiscs()
            if self.nodes >= 2 and self.verify != "off":
                self._verify_rate()
            self.env = self._build_env()
        except BaseException:
            self.teardown()
            raise
        return self

    def _ip(self, *args: str) -> None:
        self._checked([self._tools["ip"], *args])

    def _checked(self, args: Sequence[str], timeout: float = 15) -> str:
        r = _run_quiet(args, timeout=timeout)
        if r.returncode != 0:
            raise ClusterError(f"'{shlex.join(args)}' failed (exit {r.returncode}): "
                               f"{r.stderr.strip()}")
        return r.stdout

    def _disable_ipv6(self, netns: str) -> None:
        # In our own namespaces only: keeps IPv6 link-local addresses (which MPI netmods may
        # pick), DAD and router solicitations off the emulated links.
        self._checked([self._tools["ip"], "netns", "exec", netns, "sh", "-c",
                       "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                       "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"])

    def _tbf(self, iface: str, netns: str) -> None:
        self._checked([self._tools["tc"], "-n", netns,
                       "qdisc", "replace", "dev", iface, "root", "tbf",
                       "rate", _tc_rate(self.rate_gbit),
                       "burst", str(self.burst_bytes),
                       "latency", "50ms"])

    def _create_network(self) -> None:
        # The bridge lives in a namespace of its own (the "switch"), not in the root
        # namespace: with br_netfilter loaded (bridge-nf-call-iptables=1, as on this VM)
        # bridged IPv4 passes the root namespace's netfilter hooks, and there the TCP SYNs
        # between nodes were silently dropped while ARP passed (likely the same reason the
        # root namespace cannot connect into the namespaces).  A fresh namespace has no
        # rules, and the root namespace then holds no interface of ours at all.
        sw, br = self.switch_namespace, self.bridge
        self._ip("netns", "add", sw)
        self._disable_ipv6(sw)
        self._ip("-n", sw, "link", "add", br, "type", "bridge")
        self._ip("-n", sw, "link", "set", br, "up")
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            veth = self._veth(i)
            self._ip("netns", "add", ns)
            self._disable_ipv6(ns)
            # Created in the switch namespace with the peer put straight into the node
            # namespace, so the shared node-side name "aiak0" never exists where parallel
            # runs could collide.
            self._ip("-n", sw, "link", "add", veth, "type", "veth", "peer", "name", IFACE_NAME,
                     "netns", ns)
            self._ip("-n", sw, "link", "set", veth, "master", br)
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE_NAME)
            # tbf shapes egress only: the node end caps what the node sends, the switch end
            # what it receives.
            self._tbf(IFACE_NAME, ns)
            self._tbf(veth, sw)
            self._ip("-n", ns, "link", "set", IFACE_NAME, "up")
            self._ip("-n", sw, "link", "set", veth, "up")

    def _write_agent(self) -> None:
        assert self._tmpdir is not None
        mapping = {}
        for addr, ns, name in zip(self.addresses, self.namespaces, self.node_names):
            mapping[addr] = (ns, name)
            mapping[name] = (ns, name)  # also accept node names, for hand-written host lists
        config = os.path.join(self._tmpdir, "launch_agent.json")
        launch_agent.write_config(config, mapping, ip=self._tools["ip"],
                                  unshare=self._tools["unshare"],
                                  hostname=self._tools["hostname"])
        # Hydra takes one executable path for -launcher-exec, so a one-line wrapper binds
        # this interpreter, the agent and this run's configuration together.
        path = os.path.join(self._tmpdir, "launch_agent")
        with open(path, "w") as f:
            f.write("#!/bin/sh\nexec " + shlex.join(
                [os.path.realpath(sys.executable), "-I", _AGENT_PROGRAM, config]) + ' "$@"\n')
        os.chmod(path, 0o755)
        # Hydra's HYDRA_HOST_FILE format: one "host:slots" per line.
        with open(os.path.join(self._tmpdir, "hostfile"), "w") as f:
            f.writelines(f"{h}:{self.ranks_per_node}\n" for h in self.hosts)
        self._agent = path

    def _check_qdiscs(self) -> None:
        """Read back every tbf we set: a silently missing qdisc would mean an unshaped link."""
        for i, ns in enumerate(self.namespaces):
            for netns, dev in ((ns, IFACE_NAME), (self.switch_namespace, self._veth(i))):
                cmd = [self._tools["tc"]] + (["-n", netns] if netns else []) + [
                    "qdisc", "show", "dev", dev]
                out = self._checked(cmd)
                m = re.search(r"qdisc tbf \S+ root .*?rate (\S+)", out)
                if not m:
                    raise ClusterError(f"no tbf qdisc on {dev} ({netns or 'root ns'}): {out!r}")
                got = parse_rate(m.group(1))
                if abs(got / self.rate_gbit - 1) > 0.01:
                    raise ClusterError(f"tbf on {dev} has rate {m.group(1)}, "
                                       f"expected {self.rate_gbit:g} Gbit/s")

    def measure_link(self, src: int = 0, dst: int = 1, seconds: float | None = None
                     ) -> dict[str, float]:
        """Measure one TCP stream from node ``src`` to node ``dst``; returns a report dict.

        Bounded in time (``seconds`` of sending, default ``measure_seconds``) and in size (3x
        what the nominal rate could carry in that time), so it cannot run away.
        """
        seconds = self.measure_seconds if seconds is None else seconds
        ip = self._tools["ip"]
        py = os.path.realpath(sys.executable)
        cap = int(self.rate_gbit * 1e9 / 8 * seconds * 3) + (16 << 20)
        # Skip the first bytes: the tbf bucket and TCP slow start distort the start.
        warm = self.burst_bytes + (1 << 20)
        limit = seconds + 15
        sink = subprocess.Popen(
            [ip, "netns", "exec", self.namespaces[dst], py, "-I", _PROBE_PROGRAM, "sink",
             self.addresses[dst], str(PROBE_PORT), str(limit), str(warm)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([sink.stdout], [], [], 15)
            if not ready or sink.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise ClusterError(f"link probe receiver did not start: {sink.stderr.read()}"
                                   if sink.poll() is not None else
                                   "link probe receiver did not start in 15 s")
            src_proc = _run_quiet(
                [ip, "netns", "exec", self.namespaces[src], py, "-I", _PROBE_PROGRAM,
                 "source", self.addresses[dst], str(PROBE_PORT), str(seconds), str(cap)],
                timeout=limit + 5)
            if src_proc.returncode != 0:
                raise ClusterError(f"link probe sender failed (node {src} -> node {dst}): "
                                   f"{src_proc.stderr.strip()}")
            out, err = sink.communicate(timeout=limit)
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
        try:
            report = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise ClusterError(f"link probe receiver failed: {err.strip()}") from None
        if report["seconds"] <= 0.05:
            raise ClusterError(f"link probe too short to measure: {report}")
        gbit = report["bytes"] * 8 / report["seconds"] / 1e9
        return {"src": src, "dst": dst, "bytes": report["bytes"], "seconds": report["seconds"],
                "gbit": gbit, "nominal_gbit": self.rate_gbit}

    def _verify_rate(self) -> None:
        report = self.measure_link(0, 1)
        self.link_report = report
        self.measured_gbit = float(report["gbit"])
        deviation = self.measured_gbit / self.rate_gbit - 1
        self._log(f"{self.prefix}: measured link {self.measured_gbit:.3f} Gbit/s "
                  f"(TCP goodput node0->node1, {report['bytes'] / 1e6:.0f} MB in "
                  f"{report['seconds']:.2f} s; nominal {self.rate_gbit:g}, {deviation:+.1%})")
        if abs(deviation) > self.tolerance:
            why = ("the CPU is probably too busy to drive the link" if deviation < 0 else
                   "the shaping is not effective")
            message = (f"measured cross-node rate {self.measured_gbit:.3f} Gbit/s is "
                       f"{deviation:+.1%} off the requested {self.rate_gbit:g} Gbit/s "
                       f"(tolerance {self.tolerance:.0%}): {why}, so figures from this "
                       f"cluster would be wrong")
            if self.verify == "require":
                raise LinkRateMismatch(message)
            banner = "!" * 78
            self._log(f"{banner}\nWARNING: {message}\n{banner}")
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _build_env(self) -> dict[str, str]:
        assert self._agent is not None and self._tmpdir is not None
        env = {
            "AIAK_CLUSTER_HOSTS": self.host_spec,
            "AIAK_CLUSTER_LAUNCHER_EXEC": self._agent,
            "AIAK_CLUSTER_IFACE": IFACE_NAME,
            "AIAK_CLUSTER_NODES": str(self.nodes),
            "AIAK_CLUSTER_RANKS_PER_NODE": str(self.ranks_per_node),
            "AIAK_CLUSTER_LINK_GBIT": (f"{self.measured_gbit:.4f}" if self.measured_gbit
                                       is not None else f"{self.rate_gbit:g}"),
            "AIAK_CLUSTER_LINK_MEASURED": "1" if self.measured_gbit is not None else "0",
            "AIAK_CLUSTER_NOMINAL_GBIT": f"{self.rate_gbit:g}",
            "AIAK_CLUSTER_NODE_NAMES": ",".join(self.node_names),
            "AIAK_CLUSTER_PREFIX": str(self.prefix),
        }
        mpiexec = _find_mpiexec()
        if mpiexec:
            env["AIAK_CLUSTER_MPIEXEC"] = mpiexec
        env.update(self.mpi_env)
        if self.hydra_env:
            # Defaults for a plain `mpiexec` (explicit command-line options still win).
            env.update({
                "HYDRA_LAUNCHER": "ssh",
                "HYDRA_LAUNCHER_EXEC": self._agent,
                "HYDRA_IFACE": IFACE_NAME,
                "HYDRA_HOST_FILE": os.path.join(self._tmpdir, "hostfile"),
            })
        return env

    # -- running commands -------------------------------------------------------------------

    def mpiexec_args(self, nranks: int | None = None) -> list[str]:
        """Plain ``mpiexec`` arguments that place ranks on this cluster (see module function)."""
        return mpiexec_args(nranks, env=self.env)

    def run(
        self,
        cmd: Sequence[str] | str,
        env: Mapping[str, str | None] | None = None,
        timeout: float | None = None,
        *,
        node: int = 0,
        check: bool = False,
        reap: bool = True,
        input: str | bytes | None = None,
        **popen_kwargs: object,
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` in node ``node``'s namespace with that node's hostname.

        ``cmd`` is an argv list, or a string run through ``sh -c``.  The environment is this
        process's, plus :attr:`env`, plus ``env`` (a value of None unsets a variable).
        ``input``, ``check`` and ``capture_output`` work as in ``subprocess.run``; other
        ``popen_kwargs`` (``text``, ``cwd``, ``stdout``...) go to ``subprocess.Popen``.
        On timeout the command's process group and every process in the namespaces are
        killed, then ``subprocess.TimeoutExpired`` is raised.  With ``reap`` (default),
        processes the command left behind in the namespaces (e.g. orphaned ranks of a failed
        job) are killed afterwards, so they cannot skew the next measurement.
        """
        if not self._started or self._torn_down or self.prefix is None:
            raise ClusterError("cluster is not running (use it as a context manager)")
        if not 0 <= node < self.nodes:
            raise ValueError(f"node must be in 0..{self.nodes - 1}")
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise ValueError("empty command")
        full_env = dict(os.environ)
        full_env.update(self.env)
        for key, value in (env or {}).items():
            if value is None:  # None removes a variable, e.g. one of MPI_TRANSPORT_ENV
                full_env.pop(key, None)
            else:
                full_env[key] = value
        capture = bool(popen_kwargs.pop("capture_output", False))
        if capture:
            popen_kwargs.setdefault("stdout", subprocess.PIPE)
            popen_kwargs.setdefault("stderr", subprocess.PIPE)
        if input is not None:
            popen_kwargs["stdin"] = subprocess.PIPE
        wrapped = [self._tools["ip"], "netns", "exec", self.namespaces[node],
                   self._tools["unshare"], "--uts", "sh", "-c", _HOSTNAME_EXEC, "aiak-node",
                   self.node_names[node], self._tools["hostname"], *argv]
        # A new session, so the whole job can be signalled at once and a terminal Ctrl-C
        # reaches only this process, which then stops the job and tears down in order.
        proc = subprocess.Popen(wrapped, env=full_env, start_new_session=True,
                                **popen_kwargs)  # type: ignore[call-overload]
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except BaseException:  # timeout, Ctrl-C, SIGTERM: stop the job before propagating
            self._stop_job(proc)
            raise
        finally:
            if reap:
                _kill_netns_processes(self.namespaces, keep=self._tool_pids)
        result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def _stop_job(self, proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        _kill_netns_processes(self.namespaces, grace=1.0, keep=self._tool_pids)
        # Drain pipes so no fd is left dangling (communicate after kill).
        try:
            proc.communicate(timeout=5)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            pass

    # -- impairments ------------------------------------------------------------------------

    def _require_running(self) -> None:
        if not self._started or self._torn_down or self.prefix is None:
            raise ClusterError("cluster is not running (use it as a context manager)")

    def _check_node(self, node: object) -> int:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValueError(f"node must be an integer in 0..{self.nodes - 1}, got {node!r}")
        return node

    def _tool_pids(self) -> set[int]:
        """Processes of the tool itself that live in the namespaces (the jitter tc's)."""
        return {st.proc.pid for st in self._stallers if st.proc.poll() is None}

    @property
    def impairment(self) -> dict[str, object]:
        """What :meth:`impair` applied (empty when the links are clean)."""
        return dict(self._impairment)

    @property
    def links_down(self) -> list[int]:
        """Nodes whose link is down (:meth:`link_down`)."""
        return sorted(self._links_down)

    def netem_available(self) -> bool:
        """Whether this kernel has the netem qdisc (tried once, on node 0's loopback)."""
        self._require_running()
        if self._netem is None:
            tc, ns = self._tools["tc"], self.namespaces[0]
            r = _run_quiet([tc, "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"])
            self._netem = r.returncode == 0
            if self._netem:
                _run_quiet([tc, "-n", ns, "qdisc", "del", "dev", "lo", "root"])
        return self._netem

    def _tbf_handle(self, node: int) -> str:
        out = self._checked([self._tools["tc"], "-n", self.namespaces[node], "qdisc", "show",
                             "dev", IFACE_NAME])
        m = re.search(r"qdisc tbf (\S+:) root", out)
        if not m:
            raise ClusterError(f"no tbf qdisc on node {node}'s link: {out!r}")
        return m.group(1)

    def impair(self, loss_pct: float = 0.0, jitter_ms: float = 0.0, delay_ms: float = 0.0,
               *, nodes: Sequence[int] | None = None, seed: int = 0) -> dict[str, object]:
        """Make the links of ``nodes`` (default: all) lossy and/or jittery, until
        :meth:`clear_impairments` (or teardown).  Replaces an earlier impairment.

        ``loss_pct``: share of IPv4 packets each node drops as it sends them (0..50).
        ``jitter_ms``: packets are held back by 0..jitter_ms (0..10000).  ``delay_ms``: a
        constant extra delay, which needs netem (:meth:`netem_available`).  Without netem,
        jitter is emulated by pausing each node's link at random moments (a pause holds back
        every packet sent during it, in order); with netem, netem's ``delay D J`` is used.
        ``seed`` makes the pause schedule repeatable.

        Loss limits the node interface to one segment per packet (``gso_max_segs 1``), so
        that it applies per packet; TCP connections opened *before* the call keep their
        offload size and lose whole bursts of up to 64 KiB at once.  Returns a description
        of what was applied (also :attr:`impairment`).
        """
        loss = _check_number("loss_pct", loss_pct, MAX_LOSS_PCT)
        jitter = _check_number("jitter_ms", jitter_ms, MAX_JITTER_MS)
        delay = _check_number("delay_ms", delay_ms, MAX_DELAY_MS)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an integer, got {seed!r}")
        if isinstance(nodes, (str, bytes)):
            raise TypeError(f"nodes must be a sequence of node indices, got {nodes!r}")
        targets = list(range(self.nodes)) if nodes is None else \
            sorted({self._check_node(n) for n in nodes})
        if not targets:
            raise ValueError("nodes must name at least one node")
        self._require_running()
        use_netem = bool(delay or jitter) and self.netem_available()
        if delay and not use_netem:
            raise ClusterError("a constant delay needs the netem qdisc, which this kernel "
                               "does not have; jitter_ms (emulated with link pauses) and "
                               "loss_pct work without it")
        self.clear_impairments()
        tc, ip = self._tools["tc"], self._tools["ip"]
        limit = tbf_limit_bytes(self.rate_gbit, self.burst_bytes)
        try:
            for node in targets:
                ns = self.namespaces[node]
                if loss:
                    shown = self._checked([ip, "-n", ns, "-d", "link", "show", "dev",
                                           IFACE_NAME])
                    m = re.search(r"gso_max_segs (\d+)", shown)
                    self._gso_segs[node] = m.group(1) if m else "65535"
                    self._ip("-n", ns, "link", "set", "dev", IFACE_NAME, "gso_max_segs", "1")
                    self._loss_nodes.append(node)
                    for cmd in loss_commands(tc, ns, IFACE_NAME, loss):
                        self._checked(cmd)
                if use_netem:
                    handle = self._tbf_handle(node)
                    self._netem_nodes[node] = handle
                    for cmd in netem_commands(tc, ns, IFACE_NAME, handle, delay, jitter):
                        self._checked(cmd)
                elif jitter:
                    assert self._tmpdir is not None
                    normal = tbf_change_line(IFACE_NAME, _tc_rate(self.rate_gbit),
                                             self.burst_bytes, limit)
                    paused = tbf_pause_line(IFACE_NAME, limit)
                    # Set the explicit limit once, so that pausing never resizes the queue.
                    self._checked([tc, "-n", ns, *shlex.split(normal)])
                    self._stallers.append(_LinkStaller(
                        tc, ns, IFACE_NAME, normal, paused, jitter, seed * 1000 + node,
                        os.path.join(self._tmpdir, f"jitter_n{node}.err"), f"{SUBNET}255"))
        except BaseException:
            self.clear_impairments()
            raise
        self._impairment = {
            "loss_pct": loss, "jitter_ms": jitter, "delay_ms": delay, "nodes": targets,
            "loss_method": "bpf" if loss else None,
            "jitter_method": ("netem" if use_netem else "pauses") if jitter else None,
        }
        self._log(f"{self.prefix}: impaired node link(s) {targets}: loss {loss:g}%, "
                  f"jitter {jitter:g} ms, delay {delay:g} ms")
        return self.impairment

    def clear_impairments(self) -> None:
        """Undo :meth:`impair` (links that are down stay down).  Idempotent."""
        if self.prefix is None:
            return
        tc, ip = self._tools.get("tc", "tc"), self._tools.get("ip", "ip")
        problems = []
        stallers, self._stallers = self._stallers, []
        for staller in stallers:
            errors = staller.stop()
            if errors:
                problems.append(f"jitter tc: {errors}")
        for node in self._loss_nodes:
            _run_quiet([tc, "-n", self.namespaces[node], "qdisc", "del", "dev", IFACE_NAME,
                        "clsact"])
            if node in self._gso_segs:
                _run_quiet([ip, "-n", self.namespaces[node], "link", "set", "dev", IFACE_NAME,
                            "gso_max_segs", self._gso_segs.pop(node)])
        self._loss_nodes = []
        limit = tbf_limit_bytes(self.rate_gbit, self.burst_bytes)
        for node, handle in list(self._netem_nodes.items()):
            _run_quiet(restore_child_command(tc, self.namespaces[node], IFACE_NAME, handle,
                                             limit))
        self._netem_nodes = {}
        if self._impairment:
            self._log(f"{self.prefix}: impairments cleared")
        self._impairment = {}
        if problems and not self._torn_down:
            raise ClusterError("; ".join(problems))

    def link_down(self, node: int) -> None:
        """Take node ``node``'s link down inside its namespace, as a pulled cable: packets
        are neither sent nor received, nothing is reset, TCP just retransmits."""
        node = self._check_node(node)
        self._require_running()
        self._checked(link_command(self._tools["ip"], self.namespaces[node], IFACE_NAME,
                                   up=False))
        self._links_down.add(node)
        self._log(f"{self.prefix}: node {node} link down")

    def link_up(self, node: int) -> None:
        """Bring node ``node``'s link back (its address and route come back with it)."""
        node = self._check_node(node)
        self._require_running()
        self._checked(link_command(self._tools["ip"], self.namespaces[node], IFACE_NAME,
                                   up=True))
        self._links_down.discard(node)
        self._log(f"{self.prefix}: node {node} link up")

    # -- teardown and signals ---------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._prev_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Turn the signal into an exception: `with` blocks and `finally` clauses then run,
        # which is where the teardown happens.
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def teardown(self) -> None:
        """Kill processes in the namespaces and remove every resource of this run. Idempotent."""
        with self._lock:
            if self._torn_down:
                return
            self._torn_down = True
        in_main = threading.current_thread() is threading.main_thread()
        blocked: dict[int, object] = {}
        if in_main:
            # A second Ctrl-C must not abort the cleanup half-way.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                blocked[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            if self.prefix is not None:
                try:
                    self.clear_impairments()  # stops the jitter threads and their tc's
                except (ClusterError, OSError, subprocess.SubprocessError):
                    pass
                left = _destroy(self.prefix, self._log)
                if self._tmpdir:
                    shutil.rmtree(self._tmpdir, ignore_errors=True)
                if not left:
                    _release_prefix(self.prefix)  # keep the lock on leftovers: never reused
                self._log(f"{self.prefix}: torn down" + (f" (left: {left})" if left else ""))
        finally:
            try:
                atexit.unregister(self.teardown)
            except Exception:
                pass
            if in_main:
                for sig, prev in blocked.items():
                    restore = self._prev_handlers.get(sig, prev)
                    signal.signal(sig, restore if restore is not None else signal.SIG_DFL)


# --------------------------------------------------------------------------------------------
# mpiexec helper (used inside the emulated cluster)


def mpiexec_args(nranks: int | None = None, env: Mapping[str, str] | None = None) -> list[str]:
    """``mpiexec`` argv prefix that places ``nranks`` ranks on the emulated cluster.

    Reads the ``AIAK_CLUSTER_*`` variables (from ``env`` or ``os.environ``), so it works in
    any process started by :meth:`EmulatedCluster.run` or the CLI.  ``nranks`` defaults to
    nodes x ranks_per_node; ranks fill node 0 first (block placement), as hydra does with
    ``host:slots``.  Append the program and its arguments to the returned list.
    """
    source = os.environ if env is None else env
    missing = [k for k in _ENV_KEYS if not source.get(k)]
    if missing:
        raise ClusterError(f"not inside an emulated cluster ({', '.join(missing)} unset); "
                           "run through `python -m aiak_training.testing.cluster`")
    if nranks is None:
        nranks = int(source["AIAK_CLUSTER_NODES"]) * int(source["AIAK_CLUSTER_RANKS_PER_NODE"])
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    mpiexec = source.get("AIAK_CLUSTER_MPIEXEC") or _find_mpiexec() or "mpiexec"
    return [mpiexec,
            "-launcher", "ssh",
            "-launcher-exec", source["AIAK_CLUSTER_LAUNCHER_EXEC"],
            "-iface", source["AIAK_CLUSTER_IFACE"],
            "-hosts", source["AIAK_CLUSTER_HOSTS"],
            "-n", str(nranks)]


# --------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aiak_training.testing.cluster",
        description="Run a command on an emulated cluster of NODES x RANKS_PER_NODE joined by "
                    "links of RATE (network namespaces + tc tbf). Needs root, ip, tc, unshare.",
        epilog="Example: python -m aiak_training.testing.cluster --nodes 2 --ranks-per-node 2 "
               "--rate 1gbit -- sh -c 'mpiexec -n 4 python bench.py'")
    p.add_argument("--nodes", type=int, default=2, help="number of emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="MPI slots per node, published to the launcher (default 1)")
    p.add_argument("--rate", type=_rate_arg, default=parse_rate("1gbit"),
                   help="link rate per node, e.g. 1gbit, 500mbit, 5gbit (default 1gbit)")
    p.add_argument("--burst", type=_size_arg, default=None,
                   help="tbf bucket size, e.g. 256kb (default: 0.5 ms of traffic, >= 256kb)")
    verify = p.add_mutually_exclusive_group()
    verify.add_argument("--require-rate", dest="verify", action="store_const", const="require",
                        help="fail (exit 3) if the measured rate is off by more than tolerance")
    verify.add_argument("--no-verify", dest="verify", action="store_const", const="off",
                        help="skip the throughput measurement (qdiscs are still checked)")
    p.set_defaults(verify="warn")
    p.add_argument("--tolerance", type=float, default=0.2,
                   help="allowed relative deviation of the measured rate (default 0.2)")
    p.add_argument("--measure-seconds", type=float, default=1.0,
                   help="duration of the link measurement (default 1.0)")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill the command after this many seconds (exit 124)")
    p.add_argument("--prefix", default=None, help="force a name prefix (aiakNNN)")
    p.add_argument("--cleanup-stale", action="store_true",
                   help="remove leftovers of dead runs and exit (no command needed)")
    p.add_argument("--check", action="store_true",
                   help="report whether this machine can emulate a cluster and exit (0/2)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="command to run in node 0 (put it after --)")
    return p


def parse_cli(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``args.command`` is the command without the leading ``--``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    args.command = command
    if not (args.cleanup_stale or args.check) and not command:
        parser.error("no command given; put it after --")
    if args.nodes < 1 or args.nodes > MAX_NODES:
        parser.error(f"--nodes must be in 1..{MAX_NODES}")
    if args.ranks_per_node < 1:
        parser.error("--ranks-per-node must be >= 1")
    if not 0 < args.tolerance < 1:
        parser.error("--tolerance must be in (0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the command's exit status (2: cannot emulate, 3: bad rate)."""
    args = parse_cli(argv)
    log = None if args.quiet else _default_log
    if args.check:
        ok, why = can_emulate()
        print(("can emulate: " if ok else "cannot emulate: ") + why,
              file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 2
    if args.cleanup_stale:
        reason = _static_requirements()
        if reason:
            print(f"aiak-cluster: {reason}", file=sys.stderr)
            return 2
        cleaned = cleanup_stale(_default_log)
        _default_log(f"cleaned {len(cleaned)} stale run(s)" + (f": {cleaned}" if cleaned else ""))
        if not args.command:
            return 0
    if log:
        # The loud banner is printed already; the RuntimeWarning copy would only repeat it.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=__name__)
    try:
        with EmulatedCluster(args.nodes, args.ranks_per_node, args.rate, verify=args.verify,
                             tolerance=args.tolerance, measure_seconds=args.measure_seconds,
                             burst_bytes=args.burst, prefix=args.prefix, log=log) as cluster:
            if log:
                link = ("not measured" if cluster.measured_gbit is None else
                        f"{cluster.measured_gbit:.3f} Gbit/s measured")
                log(f"{cluster.prefix}: up: nodes {', '.join(cluster.node_names)}; "
                    f"hosts {cluster.host_spec}; iface {IFACE_NAME}; link {link}; "
                    f"running: {shlex.join(args.command)}")
            proc = cluster.run(args.command, timeout=args.timeout)
            code = proc.returncode
            return 128 - code if code < 0 else code
    except ClusterUnavailable as exc:
        print(f"aiak-cluster: cannot emulate a cluster: {exc}", file=sys.stderr)
        return 2
    except LinkRateMismatch as exc:
        print(f"aiak-cluster: {exc}", file=sys.stderr)
        return 3
    except subprocess.TimeoutExpired:
        print(f"aiak-cluster: command timed out after {args.timeout} s", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print("aiak-cluster: interrupted", file=sys.stderr)
        return 130
    except ClusterError as exc:
        print(f"aiak-cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
