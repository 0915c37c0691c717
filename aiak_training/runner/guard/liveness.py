"""Workers never outlive aiakrun: a liveness connection from every task wrapper to aiakrun.

aiakrun may die in ways it cannot clean up after: ``kill -9``, the OOM killer, a lost ssh
session to the launching host.  ``PR_SET_PDEATHSIG`` only ties a process to its direct
parent on the same host, and hydra starts ranks under per-host proxies in sessions of their
own, so nothing of that reaches a rank on another host.  Instead aiakrun listens on a TCP
port and every rank's task wrapper holds one connection to it for the whole job:

* aiakrun dies (any signal, SIGKILL included): its kernel closes the connections, each
  wrapper reads end-of-file at once, stops its rank's whole process tree (SIGTERM, then
  SIGKILL after :data:`KILL_GRACE_S`) and exits;
* the launching host vanishes (power, network): no end-of-file ever comes, so the wrappers
  turn TCP keepalive on; the kernel gives the connection up after about
  :data:`KEEPALIVE_IDLE_S` + :data:`KEEPALIVE_COUNT` x :data:`KEEPALIVE_INTERVAL_S` seconds
  without an answer, and the wrapper stops its rank the same way.

The address travels in ``$AIAK_LAUNCHER_LIVENESS`` as ``TOKEN@ADDR[,ADDR...]:PORT``: the
loopback address when every rank runs on this machine, else this machine's IPv4 addresses
(a preferred interface's first).  The wrapper sends ``TOKEN RANK`` so that aiakrun ignores
stray connections.  A wrapper that cannot reach any address prints one warning and runs on
without the guard (a firewall between hosts), except that a refused loopback connection
means aiakrun is already gone.  Standard library only: the wrapper imports this.
"""
from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
from typing import Callable, List, Optional, Sequence, Tuple

from aiak_training.common.host.net import host_ipv4_addresses

LIVENESS_ENV = "AIAK_LAUNCHER_LIVENESS"
CONNECT_TIMEOUT_S = 2.0
KILL_GRACE_S = 2.0
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 4


class LivenessServer:
    """aiakrun's end: accepts the wrappers' connections and holds them open until
    :meth:`close` (or until aiakrun dies, which is the point)."""

    def __init__(self, local_only: bool, preferred_interfaces: Sequence[str] = ()):
        self.token = secrets.token_hex(16)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1" if local_only else "0.0.0.0", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        addrs = ["127.0.0.1"] if local_only else \
            host_ipv4_addresses(preferred_interfaces) + ["127.0.0.1"]
        self.addresses = list(dict.fromkeys(addrs))
        self._conns: List[socket.socket] = []
        self.ranks: List[int] = []  # ranks whose wrapper connected
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._serve, name="aiakrun-liveness", daemon=True).start()

    def env_value(self) -> str:
        """The value of ``$AIAK_LAUNCHER_LIVENESS`` for the ranks."""
        return f"{self.token}@{','.join(self.addresses)}:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn,), daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10.0)
            hello = b""
            while not hello.endswith(b"\n") and len(hello) < 256:
                chunk = conn.recv(256)
                if not chunk:
                    break
                hello += chunk
            token, _, rank = hello.decode("ascii", "replace").strip().partition(" ")
            if not secrets.compare_digest(token, self.token):
                conn.close()
                return
            conn.settimeout(None)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
                if rank.isdigit():
                    self.ranks.append(int(rank))
        except OSError:
            conn.close()

    def close(self) -> None:
        """The job is over: drop every connection (wrappers still alive then stop their
        ranks, which is right: nothing of the job may outlive aiakrun)."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        try:
            self._sock.close()
        except OSError:
            pass
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass


def parse_value(value: str) -> Tuple[str, List[str], int]:
    """``TOKEN@a,b:PORT`` -> (token, [a, b], port); ValueError if malformed."""
    token, sep, rest = value.partition("@")
    addrs, sep2, port = rest.rpartition(":")
    if not sep or not sep2 or not token or not port.isdigit() or not addrs:
        raise ValueError(f"{LIVENESS_ENV}={value!r}: expected TOKEN@ADDR[,ADDR...]:PORT")
    return token, [a for a in addrs.split(",") if a], int(port)


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, name):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
            except OSError:
                pass


def connect(value: str, rank: Optional[int]) -> Tuple[Optional[socket.socket], str]:
    """Connect to aiakrun.  Returns (socket, "") on success; (None, why) when no address
    answered; raises ConnectionRefusedError when the loopback address refused (aiakrun on
    this machine is already gone)."""
    token, addrs, port = parse_value(value)
    problems = []
    for addr in addrs:
        try:
            sock = socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT_S)
        except ConnectionRefusedError:
            if addr.startswith("127."):
                raise
            problems.append(f"{addr}:{port}: connection refused")
            continue
        except OSError as exc:
            problems.append(f"{addr}:{port}: {exc.strerror or exc}")
            continue
        try:
            sock.settimeout(None)
            _keepalive(sock)
            sock.sendall(f"{token} {'' if rank is None else rank}\n".encode("ascii"))
        except OSError as exc:
            sock.close()
            problems.append(f"{addr}:{port}: {exc.strerror or exc}")
            continue
        return sock, ""
    return None, "; ".join(problems) or "no address to try"


def watch(sock: socket.socket, on_lost: Callable[[], None]) -> threading.Thread:
    """Call ``on_lost`` (on a daemon thread) when the connection to aiakrun ends."""

    def run() -> None:
        try:
            while sock.recv(64):
                pass  # aiakrun sends nothing; data would only be ignored
        except OSError:
            pass
        on_lost()

    t = threading.Thread(target=run, name="aiak-launcher-liveness", daemon=True)
    t.start()
    return t


def warn(message: str) -> None:
    """One line on stderr (one write, so MPI's rank labels do not split it)."""
    try:
        os.write(2, f"aiakrun: warning: {message}\n".encode("utf-8", "replace"))
    except OSError:
        sys.stderr.write(f"aiakrun: warning: {message}\n")
