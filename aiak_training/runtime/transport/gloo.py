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
"""
import datetime
import functools
import itertools
import logging
import os
import pickle
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp
from aiak_training.common.env import env_float
from aiak_training.common.job.ranks import RankIdentity

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


# ---- datatypes and reduce ops ------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _datatypes() -> Dict[int, DataType]:
    """id(mpi4py datatype) -> our DataType (half types travel as UINT16: the op says which)."""
    from aiak_training.common.dtypes import mpi_datatype
    table: Dict[int, DataType] = {}
    for dtype in DataType:
        table.setdefault(id(mpi_datatype(dtype)), dtype)
    return table


@functools.lru_cache(maxsize=None)
def _builtin_ops() -> Dict[int, str]:
    from mpi4py import MPI
    return {id(MPI.SUM): "sum", id(MPI.MIN): "min", id(MPI.MAX): "max", id(MPI.PROD): "prod",
            id(MPI.LOR): "lor", id(MPI.LAND): "land", id(MPI.BAND): "band"}


_OP_WORDS = {ReduceOp.SUM: "sum", ReduceOp.AVERAGE: "sum", ReduceOp.MIN: "min",
             ReduceOp.MAX: "max", ReduceOp.PRODUCT: "prod"}


def _decode_op(op: Any) -> Tuple[str, Optional[DataType]]:
    """(reduction word, element type it implies or None) of an op from ``dtypes.mpi_op``."""
    word = _builtin_ops().get(id(op))
    if word is not None:
        return word, None
    from aiak_training.common.dtypes import user_op_key
    key = user_op_key(op)
    if key is None:
        raise ValueError(f"Gloo transport: unsupported reduce op {op!r}.")
    return _OP_WORDS[key[1]], key[0]


@functools.lru_cache(maxsize=None)
def _torch_types() -> Dict[DataType, Any]:
    import torch
    return {DataType.UINT8: torch.uint8, DataType.INT8: torch.int8, DataType.INT32: torch.int32,
            DataType.INT64: torch.int64, DataType.FLOAT16: torch.float16,
            DataType.BFLOAT16: torch.bfloat16, DataType.FLOAT32: torch.float32,
            DataType.FLOAT64: torch.float64, DataType.BOOL: torch.uint8,
            DataType.INT16: torch.int16, DataType.UINT16: torch.int16}


def _spec(buf: Any) -> Tuple[Any, int, Optional[Tuple[List[int], List[int]]], DataType]:
    """(memory, byte length, (counts, displs) or None, element type) of an mpi4py buffer
    spec: a numpy array, or ``[buffer, count | (counts, displs), datatype]``."""
    if isinstance(buf, np.ndarray):
        if buf.dtype == np.uint64:  # negotiation's bit vector: only ever reduced with BAND
            return buf, buf.nbytes, None, DataType.INT64
        dtype = {np.dtype(np.int64): DataType.INT64, np.dtype(np.int32): DataType.INT32,
                 np.dtype(np.uint8): DataType.UINT8, np.dtype(np.float32): DataType.FLOAT32,
                 np.dtype(np.float64): DataType.FLOAT64}.get(buf.dtype)
        if dtype is None:
            raise ValueError(f"Gloo transport: numpy buffers of {buf.dtype} are not supported.")
        return buf, buf.nbytes, None, dtype
    memory, count, datatype = buf
    dtype = _datatypes().get(id(datatype))
    if dtype is None:
        raise ValueError(f"Gloo transport: unsupported datatype {datatype!r}.")
    if isinstance(count, (tuple, list)):
        counts, displs = [int(c) for c in count[0]], [int(d) for d in count[1]]
        return memory, len(memory), (counts, displs), dtype
    return memory, int(count) * ITEMSIZE[dtype], None, dtype


def byte_view(memory: Any, nbytes: int):
    """A uint8 tensor over the first ``nbytes`` of ``memory`` (shared, not copied)."""
    import torch
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if isinstance(memory, np.ndarray):
        return torch.from_numpy(memory.reshape(-1).view(np.uint8))[:nbytes]
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)


class _Group:
    """``GlooComm.Get_group()``: the ranks a ``Create`` call keeps."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = list(ranks)

    def Incl(self, ranks: Sequence[int]) -> "_Group":
        return _Group([self.ranks[r] for r in ranks])

    def Free(self) -> None:
        pass


# ---- the communicator ---------------------------------------------------------------------------
class GlooComm:
    """One communicator of a Gloo world, with the mpi4py calls of
    :class:`aiak_training.runtime.transport.Comm`.

    A communicator of one rank has no process group: its collectives are local copies.
    ``Dup`` shares the process group (only the engine thread uses a world's groups, one call at
    a time, which is all a Gloo group needs); ``Split``/``Split_type``/``Create`` make new
    groups over the same store, named after the parent and a per-communicator counter that
    advances identically on every member.
    """
    transport = "gloo"

    def __init__(self, world: _World, group: Any, rank: int, size: int, key: str,
                 hostname: str):
        self.world = world
        self._group = group
        self._rank = rank
        self._size = size
        self._key = key
        self._hostname = hostname
        self._children = itertools.count()
        world.comms.append(self)

    # ---- local --------------------------------------------------------------------------
    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    def Set_errhandler(self, errhandler: Any) -> None:
        """Gloo errors are always raised as exceptions (what ERRORS_RETURN asks of MPI)."""

    def Free(self) -> None:
        self._group = None

    def __repr__(self) -> str:
        return f"GlooComm({self._key}, rank {self._rank} of {self._size})"

    def _pg(self):
        if self._group is None:
            if self.world.closed:
                raise RuntimeError("Gloo transport: this world was shut down.")
            raise RuntimeError(f"Gloo transport: communicator {self._key} was freed.")
        return self._group

    # ---- new communicators ------------------------------------------------------------------
    def _child(self, members: List[int], label: str) -> "GlooComm":
        key = f"{self._key}.{label}"
        rank = members.index(self._rank)
        if len(members) == self._size:
            group = self._group  # same members, same order: share the connections
        elif len(members) > 1:
            group = self.world.new_group(key, rank, len(members))
        else:
            group = None
        return GlooComm(self.world, group, rank, len(members), key, self._hostname)

    def Dup(self) -> "GlooComm":
        return GlooComm(self.world, self._group, self._rank, self._size,
                        f"{self._key}.d{next(self._children)}", self._hostname)

    def Split(self, color: int = 0, key: int = 0) -> Any:
        n = next(self._children)
        pairs = self.allgather((color, key))
        if color is None or color < 0:
            from mpi4py import MPI
            return MPI.COMM_NULL
        members = sorted((r for r, (c, _) in enumerate(pairs) if c == color),
                         key=lambda r: (pairs[r][1], r))
        return self._child(members, f"s{n}c{color}")

    def Split_type(self, split_type: int, key: int = 0) -> Any:
        """Node-local communicators: Gloo knows hosts by the world's hostnames."""
        n = next(self._children)
        names = self.allgather((self._hostname, key))
        order = list(dict.fromkeys(h for h, _ in names))
        members = sorted((r for r, (h, _) in enumerate(names) if h == self._hostname),
                         key=lambda r: (names[r][1], r))
        return self._child(members, f"t{n}h{order.index(self._hostname)}")

    def Get_group(self) -> _Group:
        return _Group(range(self._size))

    def Create(self, group: _Group) -> Any:
        """Members get the new communicator, the others ``MPI.COMM_NULL`` (as mpi4py)."""
        n = next(self._children)  # advances on every rank: the next name agrees everywhere
        if self._rank not in group.ranks:
            from mpi4py import MPI
            return MPI.COMM_NULL
        return self._child(sorted(group.ranks), f"c{n}")

    # ---- pickled objects ----------------------------------------------------------------------
    def allgather(self, obj: Any) -> List[Any]:
        if self._size == 1:
            return [obj]
        import torch
        pg = self._pg()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        mine = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self._size)]
        pg.allgather([lengths], [mine]).wait()
        sizes = [int(t.item()) for t in lengths]
        width = max(sizes)
        send = torch.zeros(width, dtype=torch.uint8)
        send[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        recv = [torch.empty(width, dtype=torch.uint8) for _ in range(self._size)]
        pg.allgather([recv], [send]).wait()
        return [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(recv, sizes)]

    def gather(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        gathered = self.allgather(obj)
        return gathered if self._rank == root else None

    def bcast(self, obj: Any, root: int = 0) -> Any:
        if self._size == 1:
            return obj
        import torch
        import torch.distributed as dist
        pg = self._pg()
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self._rank == root else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        pg.broadcast([length], opts).wait()
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        if self._rank == root:
            payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        pg.broadcast([payload], opts).wait()
        return obj if self._rank == root else pickle.loads(payload.numpy().tobytes())

    def barrier(self) -> None:
        if self._size > 1:
            self._pg().barrier().wait()

    # ---- raw memory -----------------------------------------------------------------------------
    def _allreduce_tensor(self, data, dtype: DataType, word: str) -> None:
        """Reduce ``data`` (a uint8 view of the elements) in place across the communicator."""
        import torch
        import torch.distributed as dist
        elems = data.view(_torch_types()[dtype])
        wide = None
        if dtype in (DataType.INT16, DataType.UINT16):
            # Gloo has no 16-bit integer kernels: reduce as int64 and narrow back, which keeps
            # MPI's wrap-around results (sums and products modulo 2**16).
            wide = elems.to(torch.int64)
            if dtype == DataType.UINT16:
                wide &= 0xFFFF
        elif dtype == DataType.BOOL and word in ("lor", "land"):
            word = "max" if word == "lor" else "min"  # 0/1 bytes: or = max, and = min
        op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
              "prod": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND}.get(word)
        if op is None:
            raise ValueError(f"Gloo transport: cannot reduce {dtype.name} with {word}.")
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        target = elems if wide is None else wide
        self._pg().allreduce([target], opts).wait()
        if wide is not None:
            elems.copy_(wide.to(elems.dtype))

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:
        from mpi4py import MPI
        word, implied = _decode_op(MPI.SUM if op is None else op)
        memory, nbytes, _, dtype = _spec(recvbuf)
        if implied is not None:
            dtype = implied
        data = byte_view(memory, nbytes)
        if sendbuf is not MPI.IN_PLACE:
            src, src_bytes, _, _ = _spec(sendbuf)
            data.copy_(byte_view(src, src_bytes))
        if self._size > 1 and nbytes:
            self._allreduce_tensor(data, dtype, word)

    def _broadcast_tensor(self, data, root: int) -> None:
        """Broadcast ``data`` (a uint8 tensor) in place from ``root``."""
        import torch.distributed as dist
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._pg().broadcast([data], opts).wait()

    def _gather_tensor(self, data, outputs: Optional[List[Any]], root: int) -> None:
        """Gather equal-sized ``data`` into ``outputs`` (one tensor per rank) on ``root``;
        ``outputs`` is None on the other ranks."""
        import torch.distributed as dist
        opts = dist.GatherOptions()
        opts.rootRank = root
        self._pg().gather([outputs] if outputs is not None else [], [data], opts).wait()

    def Bcast(self, buf: Any, root: int = 0) -> None:
        if self._size == 1:
            return
        memory, nbytes, _, _ = _spec(buf)
        if nbytes:
            self._broadcast_tensor(byte_view(memory, nbytes), root)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Equal pieces: Gloo gathers them straight into the receive buffer (no padding,
        no per-rank temporaries as in :meth:`Allgatherv`)."""
        send_mem, send_bytes, _, _ = _spec(sendbuf)
        recv_mem = _spec(recvbuf)[0]  # its count is per rank, as in MPI
        recv_bytes = send_bytes * self._size
        out, mine = byte_view(recv_mem, recv_bytes), byte_view(send_mem, send_bytes)
        if self._size == 1:
            out.copy_(mine)
        elif recv_bytes:
            self._pg()._allgather_base(out, mine).wait()

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        import torch
        send_mem, send_bytes, _, _ = _spec(sendbuf)
        recv_mem, recv_len, layout, dtype = _spec(recvbuf)
        item = ITEMSIZE[dtype]
        counts, displs = layout
        out = byte_view(recv_mem, recv_len)
        mine = byte_view(send_mem, send_bytes)
        if self._size == 1:
            out[displs[0] * item:displs[0] * item + send_bytes].copy_(mine)
            return
        # Gloo gathers equal pieces: pad every piece to the largest, then place them.
        width = max(counts) * item
        send = torch.zeros(width, dtype=torch.uint8)
        send[:send_bytes].copy_(mine)
        recv = [torch.empty(width, dtype=torch.uint8) for _ in range(self._size)]
        self._pg().allgather([recv], [send]).wait()
        for r, piece in enumerate(recv):
            start = displs[r] * item
            out[start:start + counts[r] * item].copy_(piece[:counts[r] * item])

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        import torch
        import torch.distributed as dist
        send_mem, send_len, (scounts, sdispls), dtype = _spec(sendbuf)
        recv_mem, recv_len, (rcounts, rdispls), _ = _spec(recvbuf)
        item = ITEMSIZE[dtype]
        src, dst = byte_view(send_mem, send_len), byte_view(recv_mem, recv_len)

        def packed(counts, displs, mem):
            # alltoall_base wants pieces back to back, in rank order
            total = sum(counts) * item
            if all(displs[r] == sum(counts[:r]) for r in range(len(counts))):
                return mem[:total], False
            return torch.empty(total, dtype=torch.uint8), True

        send, send_copied = packed(scounts, sdispls, src)
        if send_copied:
            off = 0
            for c, d in zip(scounts, sdispls):
                send[off:off + c * item].copy_(src[d * item:(d + c) * item])
                off += c * item
        recv, recv_copied = packed(rcounts, rdispls, dst)
        if self._size == 1:
            recv.copy_(send)
        else:
            self._pg().alltoall_base(recv, send, [c * item for c in rcounts],
                                     [c * item for c in scounts],
                                     dist.AllToAllOptions()).wait()
        if recv_copied:
            off = 0
            for c, d in zip(rcounts, rdispls):
                dst[d * item:(d + c) * item].copy_(recv[off:off + c * item])
                off += c * item

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any,
                       recvcounts: Optional[Sequence[int]] = None, op: Any = None) -> None:
        """Reduce everything, keep this rank's block: Gloo's own reduce-scatter wants equal
        blocks, the engine's may differ by one row, and this path is not a hot one."""
        from mpi4py import MPI
        word, implied = _decode_op(MPI.SUM if op is None else op)
        send_mem, send_bytes, _, dtype = _spec(sendbuf)
        recv_mem, recv_bytes, _, _ = _spec(recvbuf)
        if implied is not None:
            dtype = implied
        item = ITEMSIZE[dtype]
        counts = list(recvcounts) if recvcounts is not None else \
            [recv_bytes // item] * self._size
        whole = byte_view(send_mem, send_bytes).clone()
        if self._size > 1 and send_bytes:
            self._allreduce_tensor(whole, dtype, word)
        start = sum(counts[:self._rank]) * item
        byte_view(recv_mem, recv_bytes).copy_(whole[start:start + counts[self._rank] * item])
