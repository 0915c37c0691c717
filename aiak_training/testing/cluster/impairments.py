"""Packet loss, jitter, delay and links going down on the emulated links: the tc command
lines, the jitter threads, and :class:`LinkImpairments`, the methods of
:class:`~aiak_training.testing.cluster.EmulatedCluster` that apply them."""
from __future__ import annotations

import ctypes
import math
import os
import pty
import random
import re
import select
import shlex
import socket
import subprocess
import threading
import time
import tty
from typing import Sequence

from aiak_training.testing.cluster.constants import IFACE_NAME, SUBNET, ClusterError
from aiak_training.testing.cluster.namespaces import run_quiet
from aiak_training.testing.cluster.rates import tc_rate


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


class LinkStaller:
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



class LinkImpairments:
    """Impairing the links of a running :class:`~aiak_training.testing.cluster.EmulatedCluster`
    (its base class): loss, jitter and delay with :meth:`impair`, a node's link with
    :meth:`link_down` and :meth:`link_up`."""

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
            r = run_quiet([tc, "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"])
            self._netem = r.returncode == 0
            if self._netem:
                run_quiet([tc, "-n", ns, "qdisc", "del", "dev", "lo", "root"])
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
                    normal = tbf_change_line(IFACE_NAME, tc_rate(self.rate_gbit),
                                             self.burst_bytes, limit)
                    paused = tbf_pause_line(IFACE_NAME, limit)
                    # Set the explicit limit once, so that pausing never resizes the queue.
                    self._checked([tc, "-n", ns, *shlex.split(normal)])
                    self._stallers.append(LinkStaller(
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
            run_quiet([tc, "-n", self.namespaces[node], "qdisc", "del", "dev", IFACE_NAME,
                        "clsact"])
            if node in self._gso_segs:
                run_quiet([ip, "-n", self.namespaces[node], "link", "set", "dev", IFACE_NAME,
                            "gso_max_segs", self._gso_segs.pop(node)])
        self._loss_nodes = []
        limit = tbf_limit_bytes(self.rate_gbit, self.burst_bytes)
        for node, handle in list(self._netem_nodes.items()):
            run_quiet(restore_child_command(tc, self.namespaces[node], IFACE_NAME, handle,
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
