"""The background engine: one thread that negotiates and runs every collective.

Frontends submit (Request, TensorEntry) pairs and get integer handles back.  Only the
background thread talks to MPI, once per cycle (``HOROVOD_CYCLE_TIME``): it negotiates each
process set in id order, then executes the ready responses in the agreed order.
"""
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from mpi4py import MPI

from aiak_training.allreduce import select_algorithm
from aiak_training.common import horovod_strings as hs
from aiak_training.common.config import Config
from aiak_training.common.dtypes import free_user_ops
from aiak_training.common.exceptions import HorovodInternalError
from aiak_training.common.messages import OpType, Request, Response
from aiak_training.common.timeline import Timeline
from aiak_training.common.topology import Topology, build_topology
from aiak_training.runtime.autotune.knobs import tunable_algorithms
from aiak_training.runtime.completion import Completer
from aiak_training.runtime.controller import Controller
from aiak_training.runtime.entries import Handle, HandleTable, SetState, TensorEntry
from aiak_training.runtime.executor import Executor
from aiak_training.runtime.watchdog import Watchdog

log = logging.getLogger("aiak_training")


def _gpu_executor(cpu: Executor):
    # Imported on the first GPU response only: CPU-only jobs never load the CUDA bindings.
    from aiak_training.runtime.gpu_executor import GpuExecutor
    return GpuExecutor(cpu)


class Engine:
    kind = "python"

    def __init__(self, comm: MPI.Comm, config: Config,
                 static_process_sets: Sequence[Sequence[int]] = ()):
        self.config = config
        self.timeline = Timeline()
        self._parent_comm = comm
        self._static_sets = [list(s) for s in static_process_sets]
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # True while the engine thread is parked (see _pause): a waiter then wakes it.
        self._parked = False
        self._ready = threading.Event()
        self._sets: Dict[int, SetState] = {}
        self._next_set_id = 1
        self._foreign_sets: Dict[int, List[int]] = {}  # sets this rank is not in
        self._shutdown_requested = False
        self._stopped = False
        self._fatal: Optional[str] = None
        self._init_error: Optional[BaseException] = None
        self.topology: Optional[Topology] = None
        # CUDA device for the zeros a joined rank contributes to GPU collectives (hvd.join).
        self.join_device: int = -1
        # time.monotonic() at the start of the current cycle: the collective watchdog's only
        # input from the hot path (see runtime/watchdog.py).
        self.cycle_started = time.monotonic()
        self.watchdog: Optional[Watchdog] = None
        # The autotuner (runtime/autotune/) while it is tuning: it sees the name of every
        # allreduce the global set is given, to find step boundaries; None otherwise.
        self.autotune = None
        # Every allreduce algorithm the global set may switch to, by name: filled when autotune
        # may tune the algorithm (built at start-up, as they are collective to build).
        self.algorithms: Dict[str, object] = {}
        self._abandoned: List[TensorEntry] = []  # see abandon()
        self._thread = threading.Thread(target=self._run, name="aiak-engine", daemon=True)
        self.handles = HandleTable(alive=self._thread.is_alive,
                                   failure=lambda: self._fatal or hs.SHUT_DOWN)
        self._completer = Completer(self.handles, self.timeline)
        self.executor = Executor(config, self._completer, self._run_control,
                                 lambda: self.join_device, _gpu_executor)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: Optional[float] = None) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise ValueError("Horovod initialization failed: the background thread did not "
                             "start in time.")
        if self._init_error is not None:
            raise ValueError(f"Horovod initialization failed: {self._init_error}") \
                from self._init_error
        if self.watchdog is not None:
            self.watchdog.start()

    def shutdown(self) -> None:
        if self.watchdog is not None and self.watchdog.fired:
            # The engine thread is stuck inside MPI: neither joining it nor MPI_Finalize
            # could return, so the process ends here (exit code 75).
            self.watchdog.exit_process()
        self._end_autotune()
        self._shutdown_requested = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._ready.is_set() and not self._stopped

    def _end_autotune(self) -> None:
        """The job ends while autotune is still tuning: let it report how far it got."""
        tuner, self.autotune = self.autotune, None
        if tuner is not None:
            tuner.job_ended()

    @property
    def thread_ident(self) -> Optional[int]:
        """Thread id of the engine thread (the watchdog reads its stack when it fires)."""
        return self._thread.ident

    def abandon(self, reason: str) -> None:
        """Fail every waiting operation with ``reason`` while the engine thread is stuck
        (called by the watchdog from its own thread); later submissions raise too."""
        self._fatal = reason
        with self._lock:
            states = list(self._sets.values())
        for state in states:
            # MPI may still write into these tensors if the stuck call ever returns: keep
            # them alive until the process ends, whatever the caller drops.
            self._abandoned.extend(state.entries.values())
            self._completer.fail(state, list(state.entries), reason)
        self._completer.notify()

    # ---- process sets ------------------------------------------------------------------
    def _register_set(self, set_id: int, ranks: List[int], comm: MPI.Comm) -> None:
        cfg = self.config
        topo = build_topology(comm)
        state = SetState(
            id=set_id, ranks=ranks, comm=comm, topology=topo,
            controller=Controller(comm, cfg.cache_capacity,
                                  0.0 if cfg.stall_check_disable else cfg.stall_check_time_s,
                                  cfg.stall_shutdown_time_s),
            algorithm=select_algorithm(cfg, topo, is_global=set_id == 0))
        if set_id == 0:
            self.algorithms = tunable_algorithms(cfg, topo, state.algorithm)
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

    def _remove_set(self, set_id: int) -> bool:
        with self._lock:
            if set_id in self._foreign_sets:
                del self._foreign_sets[set_id]
                return True
            state = self._sets.pop(set_id, None)
        if state is None:
            return False
        self._completer.fail(state, list(state.entries), f"Process set {set_id} was removed.")
        self.executor.forget_set(set_id)
        state.topology.free()
        return True

    def process_set_info(self, set_id: int) -> Tuple[List[int], Optional[int], Optional[int]]:
        """(ranks, size, rank-in-set) of a registered set; size/rank None if not a member."""
        with self._lock:
            state = self._sets.get(set_id)
            if state is not None:
                return state.ranks, state.size, state.rank
            if set_id in self._foreign_sets:
                return self._foreign_sets[set_id], len(self._foreign_sets[set_id]), None
        raise ValueError(f"Process set {set_id} is not registered.")

    def process_set_table(self) -> Dict[int, List[int]]:
        """Every registered set's id and ranks, this rank a member or not."""
        with self._lock:
            table = {set_id: list(ranks) for set_id, ranks in self._foreign_sets.items()}
            table.update({set_id: list(state.ranks) for set_id, state in self._sets.items()})
        return table

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

    # ---- submission and completion -------------------------------------------------------
    def enqueue(self, set_id: int, requests: List[Request], entries: List[TensorEntry]) -> List[int]:
        """Submit requests atomically (a grouped op lands in one cycle).  Returns handles."""
        tuner = self.autotune
        if tuner is not None and set_id == 0:
            for req in requests:
                if req.op_type == OpType.ALLREDUCE:
                    tuner.on_allreduce(req.name)
        return self._enqueue(set_id, requests, entries)

    def _enqueue(self, set_id: int, requests: List[Request],
                 entries: List[TensorEntry]) -> List[int]:
        with self._lock:
            if self._fatal is not None:
                raise HorovodInternalError(self._fatal)
            if self._stopped or self._shutdown_requested:
                raise HorovodInternalError(hs.SHUT_DOWN)
            state = self._sets.get(set_id)
            if state is None:
                raise ValueError(f"Process set {set_id} is not registered on this rank "
                                 "(it was removed, or this rank is not a member).")
            seen = set()
            for entry in entries:
                name = entry.name
                if name in state.entries or name in seen:
                    raise ValueError(f"{hs.DUPLICATE_NAME} (tensor name: {name})")
                seen.add(name)
            handles = []
            for req, entry in zip(requests, entries):
                entry.handle = hid = self.handles.create()
                entry.signature = req.signature()
                state.entries[entry.name] = entry
                handles.append(hid)
            state.queue += requests
            self._trace_submitted(requests)
        return handles

    def _trace_submitted(self, requests: List[Request]) -> None:
        """Open each request's NEGOTIATE_<OP> span on the timeline (when one records)."""
        if self.timeline.active:
            for req in requests:
                self.timeline.begin(req.name, "NEGOTIATE_" + OpType(req.op_type).name)

    def submit_allreduce(self, set_id: int, rank: int, name: str, dtype: int, shape: tuple,
                         in_addr: int, out_addr: int, reduce_op: int, prescale: float,
                         postscale: float, keep: object) -> int:
        """One allreduce of host memory (``rank``: this rank in the set); returns its handle.
        The frontends' per-tensor hot path: :class:`NativeEngine` takes it without building
        Request/TensorEntry objects.  ``keep`` stays referenced until the handle is waited on."""
        tuner = self.autotune
        if tuner is not None and set_id == 0:
            tuner.on_allreduce(name)
        return self._submit_allreduce(set_id, rank, name, dtype, shape, in_addr, out_addr,
                                      reduce_op, prescale, postscale, keep)

    def _submit_allreduce(self, set_id: int, rank: int, name: str, dtype: int, shape: tuple,
                          in_addr: int, out_addr: int, reduce_op: int, prescale: float,
                          postscale: float, keep: object) -> int:
        req = Request(rank, name, OpType.ALLREDUCE, dtype, shape, reduce_op, prescale, postscale)
        entry = TensorEntry(name, dtype, shape, in_addr, out_addr, keep=keep)
        return self._enqueue(set_id, [req], [entry])[0]

    def poll(self, handle: int) -> bool:
        done = self.handles.poll(handle)
        if not done and self._parked:
            self._wake.set()
        return done

    def wait(self, handle: int) -> Handle:
        """Block until the handle completes, then forget it.  Raises on failure."""
        if self._parked:
            self._wake.set()
        return self.handles.wait(handle)

    def wait_result(self, handle: int):
        """:meth:`wait`, returning only the handle's result (the frontends' hot path)."""
        return self.wait(handle).result

    def wait_any(self, handles: Sequence[int], timeout: Optional[float] = None) -> List[int]:
        """Block until at least one of ``handles`` completes; return all that have, in the
        order given.  They stay registered: :meth:`wait` then returns their results without
        blocking.  ``[]`` when ``handles`` is empty or ``timeout`` passes first."""
        if self._parked:
            self._wake.set()
        return self.handles.wait_any(handles, timeout)

    def handle_event(self, handle: int) -> int:
        """The completion cudaEvent_t of a done GPU handle (0 for host ops or in flight)."""
        return self.handles.event(handle)

    def completion_time(self, handle: int) -> Optional[float]:
        """``time.monotonic()`` when a still-registered handle completed; None while it is
        in flight or once :meth:`wait` has cleared it."""
        return self.handles.completion_time(handle)

    # ---- read-only counters (leak checks) -------------------------------------------------
    def open_handles(self) -> int:
        """Handles created by :meth:`enqueue` and not yet cleared by :meth:`wait`: operations
        in flight plus completed ones nobody waited for.  Zero on an idle rank whose caller
        synchronized everything it submitted."""
        return len(self.handles)

    def counts(self) -> Dict[str, int]:
        """Sizes of the engine's tables, summed over this rank's process sets: open handles,
        entries and queued requests not yet executed, the negotiation tables (see
        :meth:`Controller.counts`), the process sets known, and the fusion buffer's bytes.
        In steady state none of them grows with the number of steps; a long run that sees
        one grow has found a leak.  Reading them changes nothing."""
        with self._lock:
            states = list(self._sets.values())
            out = {"open_handles": len(self.handles),
                   "process_sets": len(self._sets),
                   "foreign_process_sets": len(self._foreign_sets),
                   "entries": sum(len(s.entries) for s in states),
                   "queued_requests": sum(len(s.queue) for s in states)}
        for state in states:
            for key, value in state.controller.counts().items():
                out[key] = out.get(key, 0) + value
        out["fusion_buffer_bytes"] = self.executor.fusion_buffer_bytes
        out["timeline_tensors"] = self.timeline.tensor_count
        return out

    def in_flight(self) -> Dict[int, List[Tuple[str, int]]]:
        """(name, bytes) of the tensors submitted and not yet completed, by process set:
        what the watchdog reports when it fires.  Read from another thread."""
        with self._lock:
            states = list(self._sets.values())
        out = {}
        for state in states:
            entries = list(state.entries.values())
            if entries:
                out[state.id] = [(e.name, e.nbytes) for e in entries]
        return out

    def set_allreduce_algorithm(self, name: str) -> None:
        """Make ``name`` (one of :attr:`algorithms`) the global set's allreduce algorithm.
        Every rank must call it at the same point of its submissions, with none of the global
        set's allreduces in flight (autotune does so at a step boundary)."""
        self._sets[0].algorithm = self.algorithms[name]

    def run_control(self, set_id: int, op_type: OpType, name: str, payload=None):
        """Submit one control request (join, barrier, process-set changes) and wait for its
        result."""
        rank = self.rank_in_set(set_id)
        if rank is None:
            raise ValueError(hs.NOT_IN_PROCESS_SET)
        req = Request(rank, name, op_type, payload=payload)
        (handle,) = self.enqueue(set_id, [req], [TensorEntry(name, 0, (), 0)])
        return self.wait(handle).result

    # ---- background thread -------------------------------------------------------------
    def _initialize(self) -> bool:
        """Duplicate the communicator, register the global and static process sets, set up
        the watchdog and the timeline; record any failure for :meth:`start`.  Sets the
        ready event either way; True on success."""
        try:
            world = self._parent_comm.Dup()
            world.Set_errhandler(MPI.ERRORS_RETURN)
            self._register_set(0, list(range(world.Get_size())), world)
            self.topology = self._sets[0].topology
            cfg = self.config
            self.watchdog = Watchdog(self, world, cfg.collective_timeout_s, cfg.liveness_probe,
                                     self.topology.hostnames[self.topology.rank] or None)
            for ranks in self._static_sets:
                self._create_set(ranks)
            if self.config.timeline and self.config.timeline.upper() != "DYNAMIC" \
                    and self.topology.rank == 0:
                self.timeline.start(self.config.timeline, self.config.timeline_mark_cycles)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller of init()
            self._init_error = exc
            self._ready.set()
            return False
        self._ready.set()
        return True

    def _run(self) -> None:
        if not self._initialize():
            return
        reason = hs.SHUT_DOWN
        try:
            while True:
                started = time.monotonic()
                self.cycle_started = started
                self.timeline.mark_cycle()
                stop, why = self._cycle()
                if stop:
                    if why:
                        reason = f"{hs.SHUT_DOWN} ({why})"
                    break
                self._pause(started, idle=not self._has_local_work())
        except BaseException as exc:  # noqa: BLE001 - every pending op must learn about it
            reason = self._failed(exc)
        finally:
            self._stop(reason)

    def _has_local_work(self) -> bool:
        """Whether this rank has submitted anything that is not complete yet."""
        return any(state.entries or state.queue for state in list(self._sets.values()))

    def _pause(self, started: float, idle: bool) -> None:
        """Wait out the rest of the cycle; park for up to ``idle_park_ms`` when idle.

        Collectives are matched by order, not by time, so a rank may skip idle cycles
        without its peers noticing more than a delay: a peer that has work waits in the next
        negotiation until this rank joins it, at the latest when the park ends, or as soon
        as a thread here waits on a handle (which is when this rank's requests are ready).
        """
        cfg = self.config
        cycle_s = cfg.cycle_time_ms / 1000.0
        park_s = cfg.idle_park_ms / 1000.0
        if idle and park_s > cycle_s:
            self._wake.clear()
            self._parked = True
            # A shutdown, a wait() or a submission racing with the flag above: re-check, so
            # a wake-up set before clear() is not lost for a whole park.
            if not self._shutdown_requested and not self._has_local_work():
                self._wake.wait(park_s - (time.monotonic() - started))
            self._parked = False
            self._wake.clear()  # the cycles that follow keep their pace
            if self._shutdown_requested:
                self._wake.set()
            return
        remaining = cycle_s - (time.monotonic() - started)
        if remaining > 0:
            self._wake.wait(remaining)

    def _failed(self, exc: BaseException) -> str:
        """Log an exception of the engine's thread; return (and keep) the failure reason
        every pending and later operation reports."""
        log.exception("aiak_training background thread failed")
        reason = f"The background thread failed: {type(exc).__name__}: {exc}"
        if self.watchdog is not None:
            # An MPI error usually means a peer vanished: name the ones that are gone.
            reason += self.watchdog.lost_peers_note()
        self._fatal = reason
        return reason

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
                    self._completer.notify()
        return False, ""

    def _run_control(self, state: SetState, resp: Response) -> None:
        """Carry out a negotiated control response, on the engine thread, in response
        order (process-set changes are collectives over the global set)."""
        result = None
        if resp.op_type == OpType.JOIN:
            state.controller.mark_unjoined()
            result = resp.last_joined
        elif resp.op_type == OpType.ADD_PROCESS_SET:
            result = self._create_set(list(resp.payload))
        elif resp.op_type == OpType.REMOVE_PROCESS_SET:
            result = self._remove_set(resp.payload[0])
        self._completer.finish(state, [resp], result=result)

    def _stop(self, reason: str) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        with self._lock:
            self._stopped = True
            states = list(self._sets.values())
        for state in states:
            self._completer.fail(state, list(state.entries), reason)
        self._completer.notify()
        self._release(clean=self._fatal is None and reason == hs.SHUT_DOWN)

    def _release(self, clean: bool) -> None:
        """Close the timeline and free GPU and MPI resources once the engine has stopped."""
        self.timeline.stop()
        # NCCL communicators are aborted (not destroyed) unless every rank agreed to stop:
        # a vanished peer would make a clean destroy wait forever.
        self.executor.close(clean=clean)
        # Free communicators only on a clean shutdown: after a failure a peer may be gone.
        if self._fatal is None:
            with self._lock:
                states = list(self._sets.values())
            for state in reversed(states):
                state.topology.free()
        free_user_ops()
