"""The background engine: one thread that negotiates and runs every collective.

Frontends submit (Request, TensorEntry) pairs and get integer handles back.  Only the
background thread talks to MPI, once per cycle (``HOROVOD_CYCLE_TIME``): it negotiates each
process set in id order, then executes the ready responses in the agreed order.
"""
import logging
import threading
import time
from dataclasses import dataclass, field
from itertools import count as _counter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mpi4py import MPI

from aiak_training.allreduce import select_algorithm
from aiak_training.common.config import Config
from aiak_training.common.controller import Controller
from aiak_training.common.dtypes import ITEMSIZE, DataType, free_user_ops
from aiak_training.common.exceptions import HorovodInternalError
from aiak_training.common.messages import OpType, Request, Response
from aiak_training.common.timeline import Timeline
from aiak_training.common.topology import Topology, build_topology

log = logging.getLogger("aiak_training")

SHUT_DOWN_MESSAGE = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an "
    "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in "
    "the log before the first shutdown message.")

DUPLICATE_NAME_MESSAGE = (
    "Requested to {op} a tensor with the same name as another tensor that is currently being "
    "processed.  If you want to request another tensor, use a different tensor name. "
    "(tensor name: {name})")


class Handle:
    """Completion state of one submitted tensor.  Waiters sleep on the engine's condition,
    which is notified once per cycle rather than once per tensor."""
    __slots__ = ("done", "error", "result", "done_at", "event")

    def __init__(self) -> None:
        self.done = False
        self.error: Optional[str] = None
        self.result = None
        self.done_at: Optional[float] = None  # time.monotonic() at completion (statistics)
        # GPU ops complete when their work is enqueued: a cudaEvent recorded after it, which
        # the consumer's stream must wait on (see aiak_training.common.gpu).
        self.event: int = 0


class TensorEntry:
    """One tensor of one rank, as raw memory.

    ``allocate(shape) -> addr`` is called on the engine thread for ops whose output shape is
    only known after negotiation (allgather, alltoall, reducescatter).

    GPU tensors (``device >= 0``) carry device addresses, the raw ``cudaStream_t`` of the
    producer and a ``cudaEvent_t`` recorded on it at submission (``ready_event``), which the
    engine's stream waits on before it touches the tensor.

    A plain slotted class, with ``count`` and ``nbytes`` computed once: one is built per tensor
    per step, and the engine reads its sizes several times.
    """
    __slots__ = ("name", "dtype", "shape", "in_addr", "out_addr", "allocate", "handle",
                 "signature", "keep", "device", "stream", "ready_event", "count", "nbytes")

    def __init__(self, name: str, dtype: DataType, shape: Tuple[int, ...], in_addr: int,
                 out_addr: int = 0, allocate: Optional[Callable[[Tuple[int, ...]], int]] = None,
                 handle: int = -1, signature: Optional[tuple] = None, keep: object = None,
                 device: int = -1, stream: int = 0, ready_event: int = 0):
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.in_addr = in_addr
        self.out_addr = out_addr
        self.allocate = allocate
        self.handle = handle
        self.signature = signature
        self.keep = keep  # references that must outlive the operation
        self.device = device
        self.stream = stream
        self.ready_event = ready_event
        count = 1
        for d in shape:
            count *= d
        self.count = count
        self.nbytes = count * ITEMSIZE[dtype]


@dataclass
class ProcessSetState:
    id: int
    ranks: List[int]
    comm: MPI.Comm
    topology: Topology
    controller: Controller
    algorithm: Callable
    queue: List[Request] = field(default_factory=list)
    entries: Dict[str, TensorEntry] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()


class Engine:
    def __init__(self, comm: MPI.Comm, config: Config,
                 static_process_sets: Sequence[Sequence[int]] = ()):
        self.config = config
        self.timeline = Timeline()
        self._parent_comm = comm
        self._static_sets = [list(s) for s in static_process_sets]
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._completed = threading.Condition(threading.Lock())
        self._handles: Dict[int, Handle] = {}
        self._handle_ids = _counter(1)
        self._sets: Dict[int, ProcessSetState] = {}
        self._next_set_id = 1
        self._foreign_sets: Dict[int, List[int]] = {}  # sets this rank is not in
        self._shutdown_requested = False
        self._stopped = False
        self._fatal: Optional[str] = None
        self._init_error: Optional[BaseException] = None
        self.topology: Optional[Topology] = None
        # CUDA device for the zeros a joined rank contributes to GPU collectives (hvd.join).
        self.join_device: int = -1
        from aiak_training.common.operations import Executor
        self.executor = Executor(self)
        self._thread = threading.Thread(target=self._run, name="aiak-engine", daemon=True)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: Optional[float] = None) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise ValueError("Horovod initialization failed: the background thread did not "
                             "start in time.")
        if self._init_error is not None:
            raise ValueError(f"Horovod initialization failed: {self._init_error}") \
                from self._init_error

    def shutdown(self) -> None:
        self._shutdown_requested = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._ready.is_set() and not self._stopped

    # ---- process sets ------------------------------------------------------------------
    def _register_set(self, set_id: int, ranks: List[int], comm: MPI.Comm) -> None:
        cfg = self.config
        topo = build_topology(comm)
        state = ProcessSetState(
            id=set_id, ranks=ranks, comm=comm, topology=topo,
            controller=Controller(comm, cfg.cache_capacity,
                                  0.0 if cfg.stall_check_disable else cfg.stall_check_time_s,
                                  cfg.stall_shutdown_time_s),
            algorithm=select_algorithm(cfg, topo, is_global=set_id == 0))
        with self._lock:
            self._sets[set_id] = state

    def _create_set(self, ranks: List[int]) -> int:
        """Collective over the global set, in the same order on every rank."""
        world = self._sets[0].comm
        group = world.Get_group().Incl(ranks)
        comm = world.Create(group)
        group.Free()
        set_id = self._next_set_id
        self._next_set_id += 1
        if comm != MPI.COMM_NULL:
            self._register_set(set_id, ranks, comm)
        else:
            with self._lock:
                self._foreign_sets[set_id] = ranks
        return set_id

    def process_set_info(self, set_id: int) -> Tuple[List[int], Optional[int], Optional[int]]:
        """(ranks, size, rank-in-set) of a registered set; size/rank None if not a member."""
        with self._lock:
            state = self._sets.get(set_id)
            if state is not None:
                return state.ranks, state.size, state.rank
            if set_id in self._foreign_sets:
                return self._foreign_sets[set_id], len(self._foreign_sets[set_id]), None
        raise ValueError(f"Process set {set_id} is not registered.")

    def rank_in_set(self, set_id: int) -> Optional[int]:
        """This rank's rank in a set it belongs to, else None.  Lock-free, for the submission
        path: a dict read is atomic, and a set's state never changes once registered."""
        state = self._sets.get(set_id)
        return None if state is None else state.rank

    def find_process_set(self, ranks: List[int]) -> Optional[int]:
        with self._lock:
            for sid, state in self._sets.items():
                if state.ranks == ranks:
                    return sid
            for sid, r in self._foreign_sets.items():
                if r == ranks:
                    return sid
        return None

    def process_set_ids(self) -> List[int]:
        with self._lock:
            return sorted(set(self._sets) | set(self._foreign_sets))

    # ---- submission --------------------------------------------------------------------
    def enqueue(self, set_id: int, requests: List[Request], entries: List[TensorEntry]) -> List[int]:
        """Submit requests atomically (a grouped op lands in one cycle).  Returns handles."""
        with self._lock:
            if self._fatal is not None:
                raise HorovodInternalError(self._fatal)
            if self._stopped or self._shutdown_requested:
                raise HorovodInternalError(SHUT_DOWN_MESSAGE)
            state = self._sets.get(set_id)
            if state is None:
                raise ValueError(f"Process set {set_id} is not registered on this rank "
                                 "(it was removed, or this rank is not a member).")
            seen = set()
            for req, entry in zip(requests, entries):
                name = entry.name
                if name in state.entries or name in seen:
                    raise ValueError(DUPLICATE_NAME_MESSAGE.format(
                        op=OpType(req.op_type).name.lower(), name=name))
                seen.add(name)
            handles = []
            for req, entry in zip(requests, entries):
                hid = next(self._handle_ids)
                self._handles[hid] = Handle()
                entry.handle = hid
                entry.signature = req.signature()
                state.entries[entry.name] = entry
                handles.append(hid)
            state.queue += requests
            if self.timeline.active:
                for req in requests:
                    self.timeline.begin(req.name, "NEGOTIATE_" + OpType(req.op_type).name)
        return handles

    def poll(self, handle: int) -> bool:
        h = self._handles.get(handle)
        if h is None:
            raise ValueError(f"Handle {handle} was not created or has been cleared.")
        return h.done

    def handle_event(self, handle: int) -> int:
        """The completion cudaEvent_t of a done GPU handle (0 for host ops or in flight)."""
        h = self._handles.get(handle)
        return h.event if h is not None and h.done else 0

    def wait(self, handle: int) -> Handle:
        """Block until the handle completes, then forget it.  Raises on failure."""
        h = self._handles.get(handle)
        if h is None:
            raise ValueError(f"Handle {handle} was not created or has been cleared.")
        if not h.done:
            with self._completed:
                while not h.done:
                    self._completed.wait(0.5)
                    if not h.done and not self._thread.is_alive():
                        raise HorovodInternalError(self._fatal or SHUT_DOWN_MESSAGE)
        self._handles.pop(handle, None)  # atomic; enqueue only adds other handles
        if h.error is not None:
            raise HorovodInternalError(h.error)
        return h

    def complete(self, entry: TensorEntry, error: Optional[str] = None, result=None,
                 event: int = 0) -> None:
        h = self._handles.get(entry.handle)
        if h is None:
            return
        h.error, h.result, h.event = error, result, event
        h.done_at = time.monotonic()
        h.done = True

    def wait_any(self, handles: Sequence[int], timeout: Optional[float] = None) -> List[int]:
        """Block until at least one of ``handles`` completes; return all of them that have,
        in the order given.  Unlike :meth:`wait`, the handles stay registered: ``wait`` still
        returns their results (without blocking) and clears them.  Returns ``[]`` when
        ``handles`` is empty or ``timeout`` seconds pass first.  Raises if the engine died."""
        hs = []
        for hid in handles:
            h = self._handles.get(hid)
            if h is None:
                raise ValueError(f"Handle {hid} was not created or has been cleared.")
            hs.append((hid, h))
        if not hs:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        # complete() marks a handle done before _notify_completions() takes this lock, and we
        # test the flags while holding it, so a completion cannot slip in unnoticed.
        with self._completed:
            while True:
                done = [hid for hid, h in hs if h.done]
                if done:
                    return done
                if not self._thread.is_alive():
                    raise HorovodInternalError(self._fatal or SHUT_DOWN_MESSAGE)
                wait_s = 0.5
                if deadline is not None:
                    wait_s = min(wait_s, deadline - time.monotonic())
                    if wait_s <= 0:
                        return []
                self._completed.wait(wait_s)

    def completion_time(self, handle: int) -> Optional[float]:
        """``time.monotonic()`` when a still-registered handle completed; None while it is
        in flight or once it has been cleared by :meth:`wait`."""
        h = self._handles.get(handle)
        return None if h is None else h.done_at

    def _notify_completions(self) -> None:
        with self._completed:
            self._completed.notify_all()

    # ---- background thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            world = self._parent_comm.Dup()
            world.Set_errhandler(MPI.ERRORS_RETURN)
            self._register_set(0, list(range(world.Get_size())), world)
            self.topology = self._sets[0].topology
            for ranks in self._static_sets:
                self._create_set(ranks)
            if self.config.timeline and self.config.timeline.upper() != "DYNAMIC" \
                    and self.topology.rank == 0:
                self.timeline.start(self.config.timeline, self.config.timeline_mark_cycles)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller of init()
            self._init_error = exc
            self._ready.set()
            return
        self._ready.set()
        reason = SHUT_DOWN_MESSAGE
        try:
            cycle_s = self.config.cycle_time_ms / 1000.0
            while True:
                started = time.monotonic()
                self.timeline.mark_cycle()
                stop, why = self._cycle()
                if stop:
                    if why:
                        reason = f"{SHUT_DOWN_MESSAGE} ({why})"
                    break
                remaining = cycle_s - (time.monotonic() - started)
                if remaining > 0:
                    self._wake.wait(remaining)
        except BaseException as exc:  # noqa: BLE001 - every pending op must learn about it
            log.exception("aiak_training background thread failed")
            reason = f"The background thread failed: {type(exc).__name__}: {exc}"
            self._fatal = reason
        finally:
            self._stop(reason)

    def _cycle(self) -> Tuple[bool, str]:
        for set_id in sorted(self._sets):
            state = self._sets.get(set_id)
            if state is None:
                continue
            with self._lock:
                new, state.queue = state.queue, []
            want = self._shutdown_requested if set_id == 0 else False
            result = state.controller.negotiate(new, want)
            if result.shutdown:
                return True, "" if self._shutdown_requested else result.shutdown_reason
            if result.responses:
                try:
                    self.executor.execute(state, result.responses)
                finally:
                    self._notify_completions()
        return False, ""

    def _stop(self, reason: str) -> None:
        with self._lock:
            self._stopped = True
            states = list(self._sets.values())
        for state in states:
            for entry in list(state.entries.values()):
                self.complete(entry, error=reason)
            state.entries.clear()
        self._notify_completions()
        self.timeline.stop()
        # NCCL communicators are aborted (not destroyed) unless every rank agreed to stop:
        # a vanished peer would make a clean destroy wait forever.
        self.executor.close(clean=self._fatal is None and reason == SHUT_DOWN_MESSAGE)
        # Free communicators only on a clean shutdown: after a failure a peer may be gone.
        if self._fatal is None:
            for state in reversed(states):
                state.topology.free()
        free_user_ops()

    # ---- used by the executor ------------------------------------------------------------
    def handle_control(self, state: ProcessSetState, resp: Response) -> None:
        name = resp.names[0]
        entry = state.entries.pop(name, None)
        result = None
        if resp.op_type == OpType.JOIN:
            state.controller.mark_unjoined()
            result = resp.last_joined
        elif resp.op_type == OpType.ADD_PROCESS_SET:
            result = self._create_set(list(resp.payload))
        elif resp.op_type == OpType.REMOVE_PROCESS_SET:
            result = self._remove_set(resp.payload[0])
        if entry is not None:
            self.complete(entry, result=result)

    def _remove_set(self, set_id: int) -> bool:
        with self._lock:
            if set_id in self._foreign_sets:
                del self._foreign_sets[set_id]
                return True
            state = self._sets.pop(set_id, None)
        if state is None:
            return False
        for entry in list(state.entries.values()):
            self.complete(entry, error=f"Process set {set_id} was removed.")
        self.executor.forget_set(set_id)
        state.topology.free()
        return True
