"""Ray actors as the ranks of one MPI world, through MPICH's hydra with hand-started proxies.

Why this works.  An MPICH process joins a world through PMI: it needs the address of its
node's hydra proxy (``PMI_PORT``) and its rank (``PMI_ID``).  ``mpiexec -launcher manual
-pmi-port`` prints one proxy command per node instead of starting proxies over ssh; the
driver has each node's first actor run its node's command; every proxy starts
:mod:`aiak_training.ray.pmi_placeholder` once per rank of its node, and each placeholder hands
its PMI identity to the actor that is that rank.  The actor puts it in its environment before
``hvd.init()`` first imports ``mpi4py.MPI``, so ``MPI_Init`` in the actor joins the world and
the user's function keeps running inside the actor, with Ray's APIs at hand, on the native
engine and with every MPI-only feature (hierarchical allreduce through shared memory).

Hydra sees the placeholders as the ranks: when an actor goes, its placeholder's connection
closes, the placeholder exits, and hydra ends the job.  Which transport a ``RayExecutor``
uses is :func:`ray_transport`'s answer.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from aiak_training.runner.modes.mpi_flavour import Flavour, MpiNotFoundError, detect_launcher

#: ``auto`` (MPI when MPICH's hydra is installed, else Gloo), ``mpi`` or ``gloo``.
TRANSPORT_ENV = "AIAK_RAY_TRANSPORT"
# What the driver tells every placeholder (through hydra's -genv): the actors' listening
# addresses by rank, and the key the connections are authenticated with.
ADDRS_ENV = "AIAK_RAY_PMI_ADDRS"
KEY_ENV = "AIAK_RAY_PMI_KEY"
# The variables that carry an MPICH rank's identity from hydra.
_IDENTITY_PREFIXES = ("PMI_", "MPI_LOCAL")


def pmi_identity(environ: Mapping[str, str]) -> Dict[str, str]:
    """The part of a hydra-started process's environment that makes it an MPI rank."""
    return {k: v for k, v in environ.items() if k.startswith(_IDENTITY_PREFIXES)}


def hydra_launcher(environ: Optional[Mapping[str, str]] = None) -> Tuple[Optional[str], str]:
    """(path of MPICH's mpiexec, "") when actors can form an MPI world here, else
    (None, why not)."""
    try:
        launcher = detect_launcher(environ)
    except MpiNotFoundError as exc:
        return None, str(exc)
    if launcher.flavour is not Flavour.MPICH:
        return None, (f"{launcher.path} is {launcher.flavour.value}; Ray actors join an MPI "
                      "world through MPICH's hydra (mpiexec -launcher manual -pmi-port)")
    proxy = os.path.join(os.path.dirname(launcher.path), "hydra_pmi_proxy")
    if not os.access(proxy, os.X_OK):
        return None, f"no hydra_pmi_proxy beside {launcher.path}"
    return launcher.path, ""


def ray_transport(environ: Optional[Mapping[str, str]] = None) -> Tuple[str, Optional[str]]:
    """("mpi", mpiexec path) or ("gloo", None) for a fixed-size ``RayExecutor``."""
    env = os.environ if environ is None else environ
    asked = (env.get(TRANSPORT_ENV, "") or "auto").strip().lower()
    if asked not in ("auto", "mpi", "gloo"):
        raise ValueError(f"{TRANSPORT_ENV}={asked!r}: expected auto, mpi or gloo.")
    if asked == "gloo":
        return "gloo", None
    path, why = hydra_launcher(environ)
    if path is None:
        if asked == "mpi":
            raise RuntimeError(f"{TRANSPORT_ENV}=mpi, but the Ray workers cannot form an MPI "
                               f"world: {why}. Install MPICH (pip install mpich) or use "
                               f"{TRANSPORT_ENV}=gloo.")
        return "gloo", None
    return "mpi", path


# ---- the actor's half ---------------------------------------------------------------------
class PmiEndpoint:
    """Where an actor waits for its placeholder: a TCP listener whose connection is
    authenticated with the executor's key (``multiprocessing.connection``'s handshake).  The
    connection stays open for the actor's life: when it closes, the placeholder exits and
    hydra counts the rank as gone."""

    def __init__(self, key: bytes):
        self._key = key
        self._server = socket.create_server(("0.0.0.0", 0))
        self._conn: Optional[Connection] = None

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def accept(self, timeout_s: float) -> Dict[str, str]:
        """The placeholder's PMI identity; TimeoutError when it does not come in time."""
        self._server.settimeout(timeout_s)
        try:
            sock, _ = self._server.accept()
        except socket.timeout:
            raise TimeoutError(f"hydra's placeholder for this rank did not connect within "
                               f"{timeout_s:g} s") from None
        finally:
            self._server.close()
        # Connection reads the raw descriptor, which must block; the placeholder sends the
        # handshake and its identity as soon as it has connected.
        sock.setblocking(True)
        self._conn = Connection(sock.detach())
        deliver_challenge(self._conn, self._key)
        answer_challenge(self._conn, self._key)
        return self._conn.recv()


def start_proxy(command: Sequence[str]) -> int:
    """Start a node's hydra proxy from its actor; returns its pid.  The proxy is not tied to
    the actor's life: it exits on its own once its placeholders have."""
    proc = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, start_new_session=True)
    return proc.pid


# ---- the driver's half --------------------------------------------------------------------
class HydraWorld:
    """One ``mpiexec -launcher manual -pmi-port`` run: its per-node proxy commands, its output
    relayed to the driver's stderr, and its end."""

    def __init__(self, mpiexec: str, node_sizes: Sequence[int], addrs: Dict[int, Tuple[str, int]],
                 key: bytes, driver_addr: str, timeout_s: float):
        self.node_sizes = list(node_sizes)
        # Hydra's node labels: MPICH chooses shared memory or the network by them, so ranks
        # of one Ray node share memory and ranks of two nodes never assume they can.
        hosts = ",".join(f"aiaknode{k}:{n}" for k, n in enumerate(self.node_sizes))
        self.command = [mpiexec, "-launcher", "manual", "-pmi-port", "-genvnone",
                        "-hosts", hosts, "-n", str(sum(self.node_sizes)),
                        "-genv", ADDRS_ENV, json.dumps({str(r): a for r, a in addrs.items()}),
                        "-genv", KEY_ENV, key.hex(),
                        sys.executable, "-m", "aiak_training.ray.pmi_placeholder"]
        self._driver_addr = driver_addr
        self._timeout_s = timeout_s
        self._proc: Optional[subprocess.Popen] = None
        self._pump: Optional[threading.Thread] = None
        self._stopping = False

    def start(self) -> List[List[str]]:
        """Run mpiexec; returns the proxy command of each node, in node order, with the
        control port's host set to the driver's address (hydra prints its own hostname)."""
        self._proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, bufsize=1)
        commands: Dict[int, List[str]] = {}
        deadline = time.monotonic() + self._timeout_s
        lines: List[str] = []
        reader = _LineReader(self._proc.stdout)
        while True:
            line = reader.readline(deadline - time.monotonic())
            if line is None:
                self.stop()
                raise RuntimeError("mpiexec did not print its proxy commands within "
                                   f"{self._timeout_s:g} s; it printed: {''.join(lines)[-2000:]}")
            if line == "":
                raise RuntimeError(f"mpiexec exited (code {self._proc.wait()}) before printing "
                                   f"its proxy commands: {''.join(lines)[-2000:]}")
            lines.append(line)
            if line.startswith("HYDRA_LAUNCH_END"):
                break
            if line.startswith("HYDRA_LAUNCH:"):
                argv = line.split(":", 1)[1].split()
                at = argv.index("--control-port")
                port = argv[at + 1].rsplit(":", 1)[1]
                argv[at + 1] = f"{self._driver_addr}:{port}"
                proxy_id = int(argv[argv.index("--proxy-id") + 1])
                commands[proxy_id] = argv
        if sorted(commands) != list(range(len(self.node_sizes))):
            self.stop()
            raise RuntimeError(f"mpiexec printed proxy commands for {sorted(commands)}, "
                               f"expected {len(self.node_sizes)} node(s)")
        self._pump = threading.Thread(target=self._relay, args=(reader,), daemon=True,
                                      name="aiak-ray-mpiexec")
        self._pump.start()
        return [commands[k] for k in range(len(self.node_sizes))]

    def _relay(self, reader: "_LineReader") -> None:
        # Placeholders print nothing; what comes is hydra's own word on a failure.
        while True:
            line = reader.readline(None)
            if not line:
                return
            if self._stopping:  # hydra complaining that the ranks it counted are gone
                continue
            print(f"aiak_training.ray: mpiexec: {line.rstrip()}", file=sys.stderr, flush=True)

    def stop(self, grace_s: float = 5.0) -> None:
        """End mpiexec (call before the actors go: hydra's complaints are not relayed)."""
        self._stopping = True
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._pump is not None:
            self._pump.join(grace_s)


class _LineReader:
    """``readline`` with a timeout on a text pipe (a thread does the blocking reads)."""

    def __init__(self, stream):
        self._lines: List[str] = []
        self._cond = threading.Condition()
        self._done = False
        threading.Thread(target=self._read, args=(stream,), daemon=True,
                         name="aiak-ray-mpiexec-reader").start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def readline(self, timeout_s: Optional[float]) -> Optional[str]:
        """The next line; "" at the end of the stream; None on timeout."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._lines or self._done,
                                     None if timeout_s is None else max(0.0, timeout_s))
            if not ok:
                return None
            return self._lines.pop(0) if self._lines else ""


def new_key() -> bytes:
    """The secret the placeholders authenticate with (one per executor)."""
    return secrets.token_bytes(16)

