"""Collective watchdog and liveness probe: a network fault becomes a clear, bounded failure.

Why it exists.  MPI over TCP has no timeout of its own.  When a link goes down in the middle
of a collective, the engine thread sits inside an MPI call while TCP retransmits for a quarter
of an hour, and every rank waits on it.  A thread stuck inside MPI cannot be unblocked, so
the only way out is to report the failure and end the process.

How it decides.  The engine writes ``Engine.cycle_started`` (``time.monotonic()``) at the top
of every cycle; that one attribute write is the watchdog's whole cost on the hot path.  A
monitor thread wakes about once a second.  Only when a cycle has lasted longer than
``AIAK_COLLECTIVE_TIMEOUT_SECONDS`` (default 30) does it look closer:

1. **Own progress.**  A slow collective (64 MiB over a lossy 1 Gbit/s link) may sit in one
   MPI call for longer than the timeout while data still flows.  The monitor reads
   ``TCP_INFO`` of this process's TCP sockets whose far end is another rank's address: if one
   received data within the timeout, the operation is progressing.
2. **Peers' progress.**  A rank can also wait in shared memory for a node-local peer that is
   the one receiving over the network.  So the monitor asks every peer, through the liveness
   probe below, how long ago *it* made progress.  If any peer that answers did so within the
   timeout, the job is still moving.
3. Otherwise it **fires**: one line on stderr says what was in flight, which peers do not
   answer (and why: refused = process gone, timed out = host or link down) and whether this
   host's own interface is down; every waiting handle fails with ``HorovodInternalError``
   naming the same; a failure record goes to ``$AIAK_FAILURE_DIR`` for aiakrun's report.
   The process then ends with exit code :data:`WATCHDOG_EXIT_CODE` (75, ``EX_TEMPFAIL``) at
   the latest :data:`EXIT_GRACE_S` seconds later, or as soon as the program calls
   ``hvd.shutdown()`` (which ``atexit`` does).

Liveness probe.  Each rank opens a TCP listener on an ephemeral port at ``hvd.init()``, and
the ranks exchange (rank, host, IPv4 addresses, port) with one MPI allgather.  A connection
to the listener gets one JSON line back (rank and progress age) and is closed.  It is a
diagnostic, never a data path: tensors move only through MPI.  It costs nothing per step (a
blocked ``accept``), and ``AIAK_LIVENESS_PROBE=0`` turns it off; the watchdog then decides on
its own progress alone and cannot name lost peers.  The same probe names the lost peers when
the engine thread fails with an MPI error (a peer's process was killed).
"""
import errno
import faulthandler
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from mpi4py import MPI

from aiak_training.common.config import Config
from aiak_training.common.host.net import interface_is_up, local_ipv4_addresses
from aiak_training.common.job.records import FAILURE_DIR_ENV, RankFailure, drop_record

log = logging.getLogger("aiak_training")

#: Exit status of a process ended by the watchdog (``EX_TEMPFAIL``: "try again later").
WATCHDOG_EXIT_CODE = 75
#: Time the program gets, after its waiting operations failed, to end by itself (print its
#: traceback, run ``finally`` blocks) before the watchdog ends the process.
EXIT_GRACE_S = 5.0
#: Liveness probe: TCP connect and reply timeouts.  Short, since the probe runs when
#: something already failed; a live host answers a connect in well under a millisecond.
PROBE_CONNECT_TIMEOUT_S = 2.0
PROBE_REPLY_TIMEOUT_S = 2.0
#: Addresses of one peer tried, at most (a host may have many interfaces).
_MAX_ADDRESSES = 4
_TCP_ESTABLISHED = 1
# struct tcp_info (linux/tcp.h): tcpi_last_data_recv is the u32 at byte 52, in ms.
_TCPI_LAST_DATA_RECV = 52
_TCPI_MIN_BYTES = 104


# ---- this host: TCP sockets (its interfaces: common/host/net.py) -------------------------
def _plain_ipv4(host: str) -> str:
    return host[7:] if host.startswith("::ffff:") else host


def tcp_receive_age(remote: Set[str]) -> Optional[float]:
    """Seconds since this process last received TCP data from one of the ``remote``
    addresses (over all its established sockets), None if it has no such socket.

    Reads ``TCP_INFO`` through duplicates of this process's own descriptors; nothing is
    sent, and the sockets are not otherwise touched.
    """
    best: Optional[float] = None
    if not hasattr(socket, "TCP_INFO"):  # not Linux: no evidence, only the engine's cycles
        return None
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:  # closes the duplicate only
            try:
                if sock.type != socket.SOCK_STREAM or \
                        sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if _plain_ipv4(sock.getpeername()[0]) not in remote:
                    continue
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_MIN_BYTES)
            except OSError:
                continue
        if len(info) < _TCPI_LAST_DATA_RECV + 4 or info[0] != _TCP_ESTABLISHED:
            continue
        age = struct.unpack_from("I", info, _TCPI_LAST_DATA_RECV)[0] / 1000.0
        best = age if best is None else min(best, age)
    return best


# ---- peers and the probe -------------------------------------------------------------------
@dataclass(frozen=True)
class PeerInfo:
    """What every rank learns about the others at ``hvd.init()``."""
    rank: int
    host: str
    addresses: Tuple[str, ...]   # IPv4 addresses of the peer's host, loopback excluded
    interfaces: Tuple[str, ...]  # the interfaces carrying them, in the same order
    port: int                    # its liveness listener, 0 if the probe is off there
    pid: int


@dataclass(frozen=True)
class PeerStatus:
    """The answer of one peer to the liveness probe."""
    peer: PeerInfo
    answered: bool
    progress_age: Optional[float] = None  # seconds since the peer last made progress
    problem: str = ""                     # why it did not answer
    gone: bool = False                    # its host refused: nothing listens, process gone


def probe_peer(peer: PeerInfo, same_host: bool,
               connect_timeout: float = PROBE_CONNECT_TIMEOUT_S,
               reply_timeout: float = PROBE_REPLY_TIMEOUT_S) -> PeerStatus:
    """Connect to a peer's liveness listener and read its one-line answer."""
    if peer.port <= 0:
        return PeerStatus(peer, False, problem="its liveness probe is off")
    addresses = list(peer.addresses[:_MAX_ADDRESSES])
    if same_host:  # the listener binds every address; loopback works even with links down
        addresses.insert(0, "127.0.0.1")
    if not addresses:
        return PeerStatus(peer, False, problem="it has no address to probe")
    problems = []
    refused_all = True
    for addr in addresses:
        try:
            conn = socket.create_connection((addr, peer.port), timeout=connect_timeout)
        except ConnectionRefusedError:
            problems.append(f"{addr}: connection refused")
            continue
        except socket.timeout:
            refused_all = False
            problems.append(f"{addr}: no answer to a TCP connect in {connect_timeout:g} s")
            continue
        except OSError as exc:
            refused_all = False
            problems.append(f"{addr}: {errno.errorcode.get(exc.errno or 0, '')} "
                            f"{exc.strerror or exc}".strip())
            continue
        with conn:
            conn.settimeout(reply_timeout)
            data = b""
            try:
                while not data.endswith(b"\n") and len(data) < 4096:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            except OSError:
                pass
        try:
            reply = json.loads(data.decode("utf-8", "replace"))
            return PeerStatus(peer, True, progress_age=float(reply["age"]))
        except (ValueError, KeyError, TypeError):
            # The host accepted the connection, so the process exists; its other
            # addresses would only tell the same after another wait.
            return PeerStatus(peer, False, problem=f"{addr}: connected, but no reply in "
                              f"{reply_timeout:g} s (the process is alive but not responding)")
    return PeerStatus(peer, False, problem="; ".join(problems), gone=refused_all)


def probe_peers(peers: Sequence[PeerInfo], me: PeerInfo) -> List[PeerStatus]:
    """Probe every peer in parallel; the answers in the order of ``peers``."""
    results: Dict[int, PeerStatus] = {}

    def one(peer: PeerInfo) -> None:
        same = bool(peer.addresses) and set(peer.addresses) == set(me.addresses)
        results[peer.rank] = probe_peer(peer, same_host=same or peer.host == me.host)

    threads = [threading.Thread(target=one, args=(p,), name="aiak-probe", daemon=True)
               for p in peers]
    for t in threads:
        t.start()
    # Every probe is bounded by its own timeouts; the join bound only guards against a bug.
    limit = time.monotonic() + (PROBE_CONNECT_TIMEOUT_S + PROBE_REPLY_TIMEOUT_S) \
        * (_MAX_ADDRESSES + 1) + 1
    for t in threads:
        t.join(max(0.0, limit - time.monotonic()))
    return [results.get(p.rank, PeerStatus(p, False, problem="the probe did not finish"))
            for p in peers]


def describe_unanswered(statuses: Sequence[PeerStatus]) -> str:
    """``ranks 2, 3 (host n1) do not answer: 192.0.2.2: ...``, one part per host (its ranks'
    distinct problems joined by " / "); "" if every peer answered."""
    by_host: Dict[str, List[PeerStatus]] = {}
    for s in statuses:
        if not s.answered:
            by_host.setdefault(s.peer.host, []).append(s)
    parts = []
    for host, lost in by_host.items():
        ranks = [s.peer.rank for s in lost]
        who = (f"rank {ranks[0]}" if len(ranks) == 1
               else "ranks " + ", ".join(str(r) for r in ranks))
        verb = "does" if len(ranks) == 1 else "do"
        why = " (its process is gone)" if all(s.gone for s in lost) else ""
        problems = " / ".join(dict.fromkeys(s.problem for s in lost))
        parts.append(f"{who} (host {host}) {verb} not answer{why}: {problems}")
    return "; ".join(parts)


class _Listener:
    """The liveness listener: a blocked ``accept`` on a daemon thread."""

    def __init__(self, answer: Callable[[], dict]):
        self._answer = answer
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="aiak-liveness",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            try:
                with conn:
                    conn.settimeout(PROBE_REPLY_TIMEOUT_S)
                    conn.sendall((json.dumps(self._answer()) + "\n").encode())
            except Exception:  # noqa: BLE001 - a broken probe must never hurt the job
                continue

    def close(self) -> None:
        # shutdown() wakes the blocked accept(); close() alone would not.
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


# ---- the watchdog --------------------------------------------------------------------------
class EngineView(Protocol):
    """What the watchdog uses of the engine (runtime/engine.py).  A protocol, because the
    engine imports this module and the import graph must stay free of cycles."""

    config: Config
    cycle_started: float

    @property
    def running(self) -> bool: ...

    def abandon(self, reason: str) -> None: ...

    def in_flight(self) -> Dict[int, List[Tuple[str, int]]]: ...


def _size_text(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    size = nbytes / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


class Watchdog:
    """The collective watchdog and liveness probe of one engine (see the module docstring).

    Built on the engine thread during start-up (its allgather is a collective over the
    global communicator, in the same place on every rank); :meth:`start` runs the monitor.
    """

    def __init__(self, engine: EngineView, comm: MPI.Comm, timeout_s: float, probe: bool,
                 host: Optional[str] = None):
        self._engine = engine
        self.timeout_s = timeout_s
        self.fired = False
        self.message = ""
        self._closed = threading.Event()
        self._exit_lock = threading.Lock()
        host = host or os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        self._listener: Optional[_Listener] = None
        if probe:
            try:
                self._listener = _Listener(self._answer)
            except OSError as exc:  # a diagnostic must not stop the job from starting
                log.warning("liveness probe disabled: cannot listen on a TCP port: %s", exc)
        pairs = local_ipv4_addresses() if self._listener is not None else []
        mine = PeerInfo(comm.Get_rank(), host, tuple(a for _, a in pairs),
                        tuple(i for i, _ in pairs),
                        self._listener.port if self._listener else 0, os.getpid())
        # Always exchanged, probe or not, so that the collective matches on every rank
        # whatever each rank's settings are.
        infos = comm.allgather(mine)
        self.me = mine
        self.peers = [p for p in infos if p.rank != mine.rank]
        self._peer_addresses = {a for p in self.peers for a in p.addresses} - set(mine.addresses)
        self._monitor: Optional[threading.Thread] = None

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Run the monitor (not when the timeout is 0)."""
        if self.timeout_s > 0 and self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name="aiak-watchdog",
                                             daemon=True)
            self._monitor.start()

    def close(self) -> None:
        """The engine stopped: no more monitoring, no more probe answers."""
        self._closed.set()
        if self._listener is not None:
            self._listener.close()

    # ---- progress --------------------------------------------------------------------
    def progress_age(self) -> float:
        """Seconds since this rank last made progress: an engine cycle began, or TCP data
        arrived from another rank's host."""
        now = time.monotonic()
        age = now - self._engine.cycle_started
        if age > 1.0 and self._peer_addresses:  # only a long cycle is worth the socket scan
            tcp = tcp_receive_age(self._peer_addresses)
            if tcp is not None:
                age = min(age, tcp)
        return age

    def _answer(self) -> dict:
        return {"rank": self.me.rank, "age": round(self.progress_age(), 3)}

    def _watch(self) -> None:
        timeout = self.timeout_s
        # A cycle's age includes the idle sleep before the next one (HOROVOD_CYCLE_TIME, or
        # a Gloo job's idle park).
        cfg = self._engine.config
        allowance = timeout + max(cfg.cycle_time_ms, cfg.idle_park_ms) / 1000.0
        poll = min(1.0, max(0.1, timeout / 10))
        next_query = 0.0
        while not self._closed.wait(poll):
            engine = self._engine
            if not engine.running:
                continue
            began = engine.cycle_started
            now = time.monotonic()
            if now - began < allowance or now < next_query or self.progress_age() < timeout:
                continue
            statuses = probe_peers(self.peers, self.me) if self._listener else []
            moving = [s for s in statuses if s.answered and s.progress_age is not None
                      and s.progress_age < timeout]
            if moving:
                # Some rank still receives data: a slow collective, not a hang.  Ask again
                # later rather than every poll.
                next_query = now + max(poll, timeout / 4)
                log.debug("collective watchdog: no local progress for %.0f s, but rank %d "
                          "progressed %.1f s ago", now - began, moving[0].peer.rank,
                          moving[0].progress_age)
                continue
            if self._closed.is_set() or not engine.running or engine.cycle_started != began:
                continue  # the engine moved on (or stopped) while the peers were probed
            self.fire(time.monotonic() - began, statuses)
            return

    # ---- failing ---------------------------------------------------------------------
    def lost_peers_note(self) -> str:
        """``"; rank 2 (host n1) does not answer ..."`` for an error message, "" if every
        peer answers or the probe is off.  Probes now (a few seconds at most)."""
        if self._listener is None or not self.peers:
            return ""
        text = describe_unanswered(probe_peers(self.peers, self.me))
        return f"; {text}" if text else ""

    def _own_links(self) -> str:
        down = [name for name in self.me.interfaces if interface_is_up(name) is False]
        if not down:
            return ""
        return (f"; this host's network interface{'s' if len(down) > 1 else ''} "
                f"{', '.join(down)} {'are' if len(down) > 1 else 'is'} down")

    def _in_flight(self) -> str:
        """What waits, per process set, read from the outside (no hot-path cost)."""
        engine = self._engine
        waiting = []
        try:
            for set_id, entries in sorted(engine.in_flight().items()):
                names = ", ".join(name for name, _ in entries[:4])
                more = f" and {len(entries) - 4} more" if len(entries) > 4 else ""
                nbytes = sum(n for _, n in entries)
                waiting.append(f"process set {set_id}: {len(entries)} tensor(s) waiting "
                               f"({names}{more}; {_size_text(nbytes)})")
        except RuntimeError:  # a table changed while being read: skip the detail
            pass
        return "; ".join(waiting)

    def fire(self, stuck_s: float, statuses: Sequence[PeerStatus]) -> None:
        """Report the hang, fail every waiting handle, and end the process (see module)."""
        me = self.me
        parts = [f"collective watchdog: rank {me.rank} (host {me.host}): an MPI operation "
                 f"made no progress for {stuck_s:.0f} s "
                 f"(AIAK_COLLECTIVE_TIMEOUT_SECONDS={self.timeout_s:g})"]
        lost = describe_unanswered(statuses)
        if lost:
            parts.append(lost)
        elif statuses:
            parts.append("every peer answers the liveness probe, but none made progress")
        links = self._own_links()
        flight = self._in_flight()
        message = "; ".join(parts) + links + (f"; {flight}" if flight else "")
        self.message = message
        self.fired = True
        try:
            os.write(2, (f"[aiak_training ERROR] {message}. Ending this process with exit "
                         f"code {WATCHDOG_EXIT_CODE}.\n").encode("utf-8", "replace"))
        except OSError:
            pass
        detail = ("was stopped by the collective watchdog: no progress for "
                  f"{stuck_s:.0f} s" + (f"; {lost}" if lost else "") + links)
        write_failure_record(me.rank, me.host, WATCHDOG_EXIT_CODE, detail)
        self._engine.abandon(message)
        # Last resort, from a C thread that needs no GIL: if this interpreter cannot run the
        # exit below (e.g. it is finalizing inside MPI), faulthandler ends it (status 1).
        try:
            faulthandler.dump_traceback_later(EXIT_GRACE_S + 10, exit=True)
        except (RuntimeError, ValueError):
            pass
        # The program gets the grace period to end by itself (hvd.shutdown() ends it too).
        time.sleep(EXIT_GRACE_S)
        self.exit_process()

    def exit_process(self) -> None:
        """End the process now with :data:`WATCHDOG_EXIT_CODE` (the engine thread is stuck
        inside MPI, so neither ``MPI_Finalize`` nor a normal interpreter exit could finish)."""
        with self._exit_lock:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream must not prevent the exit
                    pass
            os._exit(WATCHDOG_EXIT_CODE)


def write_failure_record(rank: int, host: str, returncode: int, detail: str,
                         directory: Optional[str] = None) -> None:
    """Leave a failure record for aiakrun (a :class:`RankFailure`, common/job/records.py).

    Does nothing without ``$AIAK_FAILURE_DIR`` or when that directory is not visible here
    (a rank on another host without a shared file system).
    """
    directory = os.environ.get(FAILURE_DIR_ENV, "") if directory is None else directory
    record = RankFailure(rank=rank, host=host, returncode=returncode, time=time.time(),
                         detail=detail)
    drop_record(directory, f"rank.{rank}.{os.getpid()}.watchdog", ".json", asdict(record))
