"""The Gloo transport: the engine's communicator calls on ``torch.distributed``'s Gloo.

Why this shape.  The engine speaks the mpi4py subset listed in
:class:`aiak_training.runtime.transport.Comm`; :class:`GlooComm` answers the same calls with
``torch.distributed.ProcessGroupGloo`` objects, so negotiation, fusion, the response cache,
process sets, the timeline and error reporting are the very code the MPI path runs.  The
process groups are built directly over a ``PrefixStore`` of one ``TCPStore`` (the
rendezvous), not through ``torch.distributed.init_process_group``: no global state of torch is
touched, a world can be torn down and formed again in the same process with another size, and
a sub-group (process set, node-local and cross-node communicators) only involves its members.

Identity comes from a *world source* (:func:`world_from_env` by default, Horovod's variable
names; an elastic driver installs its own with :func:`set_world_source`).  Every wait inside
Gloo is bounded by ``HOROVOD_GLOO_TIMEOUT_SECONDS``: a peer that vanishes turns into an
exception on the engine thread (usually at once, "connection closed"), which the engine
reports as ``HorovodInternalError`` on every waiting handle.

This module forms and closes worlds (identity, the rendezvous store, the process groups of a
world, the hooks of ``hvd.init()``/``hvd.shutdown()``); the communicator itself is
:class:`~aiak_training.runtime.transport.gloo_comm.GlooComm`.
"""
import datetime
import itertools
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Tuple

from aiak_training.common.env import env_float
from aiak_training.common.job.ranks import RankIdentity
from aiak_training.runtime.transport.gloo_comm import GlooComm

log = logging.getLogger("aiak_training")

#: Horovod's name: seconds a rendezvous or any Gloo operation may wait before it fails.
TIMEOUT_ENV = "HOROVOD_GLOO_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_S = 30.0
#: Key prefix inside the rendezvous store, so one store can host successive worlds.
PREFIX_ENV = "AIAK_GLOO_STORE_PREFIX"
#: Network interface Gloo binds to (Horovod's name); torch's GLOO_SOCKET_IFNAME also works.
IFACE_ENVS = ("HOROVOD_GLOO_IFACE", "GLOO_SOCKET_IFNAME")
#: Gloo's default for AIAK_ZERO_COPY_BYTES: tensors below it go through the fusion buffer.
GLOO_ZERO_COPY_BYTES = 1 << 40
ADDR_ENV = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
PORT_ENV = "HOROVOD_GLOO_RENDEZVOUS_PORT"
CONTROLLER_ENV = "HOROVOD_CONTROLLER"


# ---- identity -------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorldInfo(RankIdentity):
    """Who this process is in the world to form, and where the rendezvous store listens.

    ``local_*`` and ``cross_*`` are what the launcher assigned; the runtime derives its own from
    ``hostname`` (ranks of one host must be given the same hostname) and warns on a mismatch.
    ``prefix`` names this world's keys in the store: a driver that reuses one store for
    successive worlds gives each a new prefix.
    """
    addr: str
    port: int
    prefix: str = ""

    def validate(self) -> None:
        """ValueError naming the first field that cannot describe a world."""
        if self.size < 1:
            raise ValueError(f"Gloo world: size must be at least 1, got {self.size}.")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"Gloo world: rank {self.rank} is outside 0..{self.size - 1}.")
        if not self.addr:
            raise ValueError(f"Gloo world: no rendezvous address ({ADDR_ENV} is unset).")
        if not 0 < self.port < 65536:
            raise ValueError(f"Gloo world: rendezvous port {self.port} is not a TCP port "
                             f"({PORT_ENV}).")


def _required_int(name: str, env: Mapping[str, str]) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        raise ValueError(f"Gloo mode needs {name} (set by aiakrun --gloo or the elastic "
                         "driver); it is unset.")
    try:
        return int(raw, 10)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer.") from None


def world_from_env(environ: Optional[Mapping[str, str]] = None) -> WorldInfo:
    """The world described by Horovod's variables (the default world source)."""
    env = os.environ if environ is None else environ
    rank, size = _required_int("HOROVOD_RANK", env), _required_int("HOROVOD_SIZE", env)

    def optional(name: str, default: int) -> int:
        return _required_int(name, env) if env.get(name, "").strip() else default

    return WorldInfo(rank=rank, size=size,
                     local_rank=optional("HOROVOD_LOCAL_RANK", rank),
                     local_size=optional("HOROVOD_LOCAL_SIZE", size),
                     cross_rank=optional("HOROVOD_CROSS_RANK", 0),
                     cross_size=optional("HOROVOD_CROSS_SIZE", 1),
                     hostname=env.get("HOROVOD_HOSTNAME", "").strip() or socket.gethostname(),
                     addr=env.get(ADDR_ENV, "").strip(),
                     port=_required_int(PORT_ENV, env),
                     prefix=env.get(PREFIX_ENV, "").strip())


_source: Optional[Callable[[], WorldInfo]] = None


def set_world_source(fn: Optional[Callable[[], WorldInfo]]) -> None:
    """Install ``fn`` as the world source: every later ``hvd.init()`` calls it (it may block,
    e.g. until a driver announces the next world) and forms that world over Gloo.  Installing
    one selects Gloo mode; ``None`` goes back to the environment."""
    global _source
    if fn is not None and not callable(fn):
        raise ValueError(f"set_world_source expects a callable or None, got {fn!r}.")
    _source = fn


def gloo_selected(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the next ``hvd.init()`` forms a Gloo world: a world source is installed,
    ``HOROVOD_CONTROLLER=gloo``, or ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` is set (and
    ``HOROVOD_CONTROLLER`` is not ``mpi``)."""
    if _source is not None:
        return True
    env = os.environ if environ is None else environ
    controller = env.get(CONTROLLER_ENV, "").strip().lower()
    if controller == "gloo":
        return True
    if controller == "mpi":
        return False
    if controller:
        raise ValueError(f"{CONTROLLER_ENV}={controller!r}: expected 'gloo' or 'mpi'.")
    return bool(env.get(ADDR_ENV, "").strip())


def timeout_seconds(environ: Optional[Mapping[str, str]] = None) -> float:
    """``HOROVOD_GLOO_TIMEOUT_SECONDS`` (default 30)."""
    value = env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, environ=environ)
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={value}: must be positive.")
    return value


def start_rendezvous_server(host: str = "0.0.0.0", port: int = 0,
                            listen_fd: Optional[int] = None) -> Tuple[Any, int]:
    """Start the rendezvous store (a ``torch.distributed.TCPStore`` server) for launchers and
    drivers.  Returns the store and the port it listens on (``port=0`` picks a free one).
    ``listen_fd``: a socket the caller already listens on (at ``port``), so that it can start
    the ranks before paying for torch's import here; connections wait in its backlog.
    The server runs as long as the returned object lives."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_seconds())
    try:
        extra = {} if listen_fd is None else {"master_listen_fd": listen_fd}
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timeout, **extra)
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"Gloo rendezvous: cannot listen on {host}:{port}: {exc}") from exc
    return store, int(store.port)


# ---- forming a world --------------------------------------------------------------------------
_generation = itertools.count()
_worlds_lock = threading.Lock()
_live_worlds: List["_World"] = []


class _World:
    """Everything one formed world holds: the store client and its process groups, so that
    :func:`close_world` can drop them all, connections included, at ``hvd.shutdown()``."""

    def __init__(self, info: WorldInfo, store: Any, prefix: str, timeout_s: float):
        self.info = info
        self.store = store
        self.prefix = prefix
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.groups: List[Any] = []
        self.comms: List["GlooComm"] = []
        self.closed = False

    def new_group(self, key: str, rank: int, size: int) -> Any:
        """A Gloo process group of ``size`` members named ``key``; every member calls it."""
        import torch.distributed as dist
        store = dist.PrefixStore(f"{self.prefix}/{key}/", self.store)
        iface = next((os.environ[n].strip() for n in IFACE_ENVS if os.environ.get(n, "").strip()),
                     "")
        try:
            if iface:
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface)]
                opts._timeout = self.timeout
                group = dist.ProcessGroupGloo(store, rank, size, opts)
            else:
                group = dist.ProcessGroupGloo(store, rank, size, self.timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"Gloo rendezvous of {size} ranks (group {key!r}) failed within "
                               f"{self.timeout.total_seconds():g} s ({TIMEOUT_ENV}): {exc}") \
                from exc
        self.groups.append(group)
        return group

    def close(self) -> None:
        self.closed = True
        for group in self.groups:
            try:
                group.abort()  # closes its connections now: peers waiting on us fail at once
            except (RuntimeError, AttributeError):
                pass
        # Drop every reference now: a process group destroyed late, during interpreter exit,
        # aborts the process ("terminate called without an active exception").
        for comm in self.comms:
            comm.Free()
        self.comms.clear()
        self.groups.clear()
        self.store = None


def form_world(info: Optional[WorldInfo] = None) -> "GlooComm":
    """Connect to the rendezvous and form the world ``info`` describes (the world source's
    answer when None); returns its communicator.  Collective over the world's ranks."""
    import torch.distributed as dist
    if info is None:
        info = _source() if _source is not None else world_from_env()
    if not isinstance(info, WorldInfo):
        raise ValueError(f"The Gloo world source returned {info!r}, not a WorldInfo.")
    info.validate()
    timeout_s = timeout_seconds()
    from aiak_training.common.job.exit_guard import note_arrival
    note_arrival("the Gloo rendezvous")  # for aiakrun's start timeout (runner/guard/start_watch.py)
    # Without a prefix from the launcher, successive worlds of this process use fresh keys;
    # that is right when every rank re-forms together (shutdown(); init() everywhere).
    prefix = info.prefix or f"aiak/{next(_generation)}"
    try:
        store = dist.TCPStore(info.addr, info.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"Gloo rendezvous: cannot reach the store at {info.addr}:{info.port} "
                           f"within {timeout_s:g} s ({TIMEOUT_ENV}): {exc}") from exc
    world = _World(info, store, prefix, timeout_s)
    with _worlds_lock:
        _live_worlds.append(world)
    group = world.new_group("world", info.rank, info.size) if info.size > 1 else None
    return GlooComm(world, group, info.rank, info.size, "world", info.hostname)


def close_world(comm: Any = None) -> None:
    """Drop the process groups and store connection of ``comm``'s world (every live world when
    None).  Called by ``hvd.shutdown()`` after the engine stopped, also after a failure: the
    connections close, so peers still waiting on this process fail instead of waiting out
    their timeout."""
    with _worlds_lock:
        if comm is None:
            worlds, _live_worlds[:] = list(_live_worlds), []
        else:
            worlds = [w for w in _live_worlds if w is comm.world]
            _live_worlds[:] = [w for w in _live_worlds if w is not comm.world]
    for world in worlds:
        world.close()


def world_active() -> bool:
    """Whether a Gloo world formed by ``hvd.init()`` is still held (until ``hvd.shutdown()``)."""
    with _worlds_lock:
        return bool(_live_worlds)


# ---- hooks of hvd.init() / hvd.shutdown() (runtime/basics.py) ----------------------------------
def base_communicator(comm: Any = None) -> "GlooComm":
    """``hvd.init(comm)`` in Gloo mode: the world comes from the world source; ``comm`` (an
    MPI notion) must be None."""
    if comm is not None:
        raise ValueError("hvd.init(comm=...) selects MPI ranks, but this job runs over Gloo "
                         f"({CONTROLLER_ENV}=gloo / aiakrun --gloo): call hvd.init() without "
                         "comm, or use process sets.")
    return form_world()


def configure(config: Any) -> None:
    """The settings a Gloo world changes before the engine starts."""
    if not os.environ.get("AIAK_ZERO_COPY_BYTES", "").strip():
        # A Gloo call costs far more than an MPI call (a work object, a hand-off to Gloo's
        # thread, a wait), while copying into the fusion buffer runs at memory speed: pack
        # large tensors too, unless the user chose a threshold.
        config.zero_copy_bytes = GLOO_ZERO_COPY_BYTES


def release(comm: Any) -> None:
    """``hvd.shutdown()``: close a Gloo world's connections (nothing to do for MPI)."""
    if isinstance(comm, GlooComm):
        close_world(comm)
