"""The engine: the C++ background thread (csrc/engine/) and what it needs from Python.

The C++ thread owns the queues, negotiation (bit vectors, response cache, coordinator),
fusion, the stall checks and the transport calls of host allreduce and broadcast, and it
completes the handles.  Its transport is MPI (called from C++, without the GIL) or Gloo (each
call a call into :class:`~aiak_training.runtime.transport.gloo_calls.GlooCalls`, with the GIL
held for that call only).

What needs Python runs in the *lane*: the C++ thread calls :meth:`Engine._lane` with the GIL,
in the negotiated order, for GPU collectives, allgather, alltoall and reducescatter (their
results are allocated by the frontend), process-set changes, Adasum, the hierarchical
allreduce algorithms, timeline events and stall warnings.  The lane runs them with the
:class:`~aiak_training.runtime.execute.executor.Executor`.

This object holds the parts together: the C++ core, this rank's process sets
(:class:`~aiak_training.runtime.sets.set_registry.ProcessSetRegistry`), the executor, the
watchdog, the timeline, and the life cycle.  Frontends submit requests and get integer
handles back; nothing here calls into a frontend.
"""
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from mpi4py import MPI

from aiak_training.allreduce.flat import flat_allreduce
from aiak_training.common import horovod_strings as hs
from aiak_training.common import native
from aiak_training.common.config import Config
from aiak_training.common.dtypes import DataType, ReduceOp, free_user_ops, mpi_datatype
from aiak_training.common.exceptions import collective_error
from aiak_training.common.messages import OpType, Request, Response
from aiak_training.common.timeline import Timeline
from aiak_training.common.topology import Topology
from aiak_training.runtime.autotune.knobs import tunable_algorithms
from aiak_training.runtime.diagnostics.watchdog import Watchdog
from aiak_training.runtime.entries import SetState, TensorEntry, WaitResult, unknown_handle
from aiak_training.runtime.execute.completion import Completer
from aiak_training.runtime.execute.executor import Executor
from aiak_training.runtime.sets.set_registry import ProcessSetRegistry
from aiak_training.runtime.transport import transport_name

if TYPE_CHECKING:
    from aiak_training.runtime.transport.gloo_calls import GlooCalls

log = logging.getLogger("aiak_training")

# Ops the C++ thread hands to the lane whatever the tensor's device.
_LANE_OPS = frozenset({OpType.ALLGATHER, OpType.ALLTOALL, OpType.REDUCESCATTER,
                       OpType.ADD_PROCESS_SET, OpType.REMOVE_PROCESS_SET})


def _mpi_object_id(obj) -> int:
    """The value of an MPI object's C handle (``MPI_Comm``, ``MPI_Op``, ...) as a signed 64-bit
    int (mpi4py reports it unsigned): how the C++ core names MPI objects."""
    value = MPI._handleof(obj)
    return value - (1 << 64) if value >= 1 << 63 else value


def _mpi_handles() -> dict:
    """The ids of the MPI objects the C++ engine uses, from mpi4py (see csrc/engine/mpi.h)."""
    ops = {"SUM": MPI.SUM, "MIN": MPI.MIN, "MAX": MPI.MAX, "PROD": MPI.PROD, "LOR": MPI.LOR,
           "LAND": MPI.LAND, "BAND": MPI.BAND}
    out = {name: _mpi_object_id(op) for name, op in ops.items()}
    out.update(
        handle_bytes=MPI._sizeof(MPI.COMM_WORLD), in_place=int(MPI.IN_PLACE),
        UINT64_T=_mpi_object_id(MPI.UINT64_T), INT32_T=_mpi_object_id(MPI.INT32_T),
        INT64_T=_mpi_object_id(MPI.INT64_T), BYTE=_mpi_object_id(MPI.BYTE),
        dtypes=[_mpi_object_id(mpi_datatype(DataType(code))) for code in range(11)])
    return out


def stall_times(config: Config) -> Tuple[float, float, float]:
    """(warning, shutdown, deadlock) times of the stall check in seconds, 0 for off.  As in
    Horovod, a shutdown time below the warning time is ignored, with a warning.  A certain
    deadlock ends the job after the warning time, unless the user chose a shutdown rule."""
    check = 0.0 if config.stall_check_disable else config.stall_check_time_s
    shutdown = config.stall_shutdown_time_s
    if 0 < shutdown < check:
        log.warning(hs.STALL_SHUTDOWN_BELOW_WARNING)
        shutdown = 0.0
    return check, shutdown, check if config.deadlock_shutdown else 0.0


def _core_config(config: Config, gloo: Optional["GlooCalls"]) -> dict:
    """The C++ engine's settings, with the handles of its transport's objects."""
    out = _mpi_handles() if gloo is None else gloo.config()
    stall_check_s, stall_shutdown_s, deadlock_s = stall_times(config)
    out.update(
        cycle_time_s=config.cycle_time_ms / 1000.0, cache_capacity=config.cache_capacity,
        stall_check_s=stall_check_s, stall_shutdown_s=stall_shutdown_s, deadlock_s=deadlock_s,
        idle_park_s=config.idle_park_ms / 1000.0,
        ring_min_bytes=config.mpi_ring_bytes, ring_segment_bytes=config.mpi_ring_segment_bytes,
        ring_window=config.mpi_ring_window, wait_sleep_us=config.mpi_wait_sleep_us,
        wait_spin_us=config.mpi_wait_spin_us, ring_on_one_host=int(config.mpi_ring_on_one_host),
        shut_down=hs.SHUT_DOWN, duplicate_name=hs.DUPLICATE_NAME)
    return out


def _translate(exc: BaseException) -> BaseException:
    """The Horovod exception for an error raised by the C++ core."""
    if isinstance(exc, native.EngineStopped):
        return collective_error(str(exc))
    if isinstance(exc, native.BadRequest):
        return ValueError(str(exc))
    return exc


class Engine:
    def __init__(self, comm: Any, config: Config,
                 static_process_sets: Sequence[Sequence[int]] = ()):
        self.config = config
        self.timeline = Timeline()
        self._parent_comm = comm
        self._static_sets = [list(s) for s in static_process_sets]
        self.sets = ProcessSetRegistry(config)
        self._started = False
        self._stopped = False
        # Why the job failed (a thread's exception, the watchdog): every pending and later
        # operation reports it.
        self.failure: Optional[str] = None
        self.topology: Optional[Topology] = None
        # CUDA device for the zeros a joined rank contributes to GPU collectives (hvd.join).
        self.join_device: int = -1
        self.watchdog: Optional[Watchdog] = None
        # The autotuner (runtime/autotune/) while it is tuning: it sees the name of every
        # allreduce the global set is given, to find step boundaries; None otherwise.
        self.autotune = None
        # Every allreduce algorithm the global set may switch to, by name: filled when autotune
        # may tune the algorithm (built at start-up, as they are collective to build).
        self.algorithms: Dict[str, object] = {}
        self._abandoned: List[object] = []  # see abandon()
        # Gloo jobs: the C++ thread's collectives call torch's Gloo groups through Python.
        self._gloo: Optional["GlooCalls"] = None
        if transport_name(comm) == "gloo":
            from aiak_training.runtime.transport.gloo_calls import GlooCalls
            self._gloo = GlooCalls()
        self._comm_ids: Dict[int, int] = {}  # set id -> how the core names its communicator
        self.core = native.EngineCore(_core_config(config, self._gloo), self._lane, self._gloo)
        self.core.fusion_threshold = config.fusion_threshold
        self.core.zero_copy_bytes = config.zero_copy_bytes
        self.results: Dict[int, object] = {}   # handle -> result of a lane-executed op
        self._keep: Dict[int, object] = {}     # handle -> memory the op uses
        self._core_allreduce_sets = set()      # sets whose host allreduce runs in C++
        completer = Completer(self.core, self.timeline, self.results)
        self.executor = Executor(config, completer, self._run_control, lambda: self.join_device)
        self.timeline.on_active = self._timeline_changed
        config.on_change = self._config_changed

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Set up the process sets, the watchdog and the timeline (collectives over the
        job, in the same order on every rank), then start the C++ thread."""
        try:
            world = self._parent_comm.Dup()
            world.Set_errhandler(MPI.ERRORS_RETURN)
            self._register_set(0, list(range(world.Get_size())), world)
            self.topology = self.sets.get(0).topology
            cfg = self.config
            self.watchdog = Watchdog(self, world, cfg.collective_timeout_s, cfg.liveness_probe,
                                     self.topology.hostnames[self.topology.rank] or None)
            for ranks in self._static_sets:
                self._create_set(ranks)
            if cfg.timeline and cfg.timeline.upper() != "DYNAMIC" and self.topology.rank == 0:
                self.timeline.start(cfg.timeline, cfg.timeline_mark_cycles)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller of init()
            raise ValueError(f"Horovod initialization failed: {exc}") from exc
        self.core.timeline_on = self.timeline.active
        self.core.start()
        self._started = True
        self.watchdog.start()

    def shutdown(self) -> None:
        if self.watchdog is not None and self.watchdog.fired:
            # The C++ thread is stuck inside MPI: neither joining it nor MPI_Finalize could
            # return, so the process ends here (exit code 75).
            self.watchdog.exit_process()
        if self._stopped:
            return
        self._end_autotune()
        self.core.request_shutdown()
        self.core.join()
        self._stopped = True
        if self.watchdog is not None:
            self.watchdog.close()
        self.failure = self.failure or self.core.fatal() or None
        self._release(clean=self.failure is None)

    @property
    def running(self) -> bool:
        return self._started and not self._stopped and self.core.running

    @property
    def cycle_started(self) -> float:
        """``time.monotonic()`` at the start of the current cycle (the watchdog's input)."""
        return self.core.cycle_started

    def _end_autotune(self) -> None:
        """The job ends while autotune is still tuning: let it report how far it got."""
        tuner, self.autotune = self.autotune, None
        if tuner is not None:
            tuner.job_ended()

    def abandon(self, reason: str) -> None:
        """Fail every waiting operation with ``reason`` while the engine thread is stuck
        (called by the watchdog from its own thread); later submissions raise too."""
        self.failure = reason
        # MPI may still write into these tensors if the stuck call ever returns: keep them
        # alive until the process ends, whatever the caller drops.
        self._abandoned.extend(self._keep.values())
        self.core.abandon(reason)

    def _release(self, clean: bool) -> None:
        """Close the timeline and free GPU and communicator resources once stopped."""
        self.timeline.stop()
        # NCCL communicators are aborted (not destroyed) unless every rank agreed to stop:
        # a vanished peer would make a clean destroy wait forever.
        self.executor.close(clean=clean)
        # Free communicators only on a clean shutdown: after a failure a peer may be gone.
        if self.failure is None:
            for state in reversed(self.sets.states()):
                state.topology.free()
        free_user_ops()

    def _timeline_changed(self, active: bool) -> None:
        self.core.timeline_on = active

    def _config_changed(self, field: str, value) -> None:
        if field in ("fusion_threshold", "zero_copy_bytes"):
            setattr(self.core, field, int(value))
        elif field == "cycle_time_ms":
            self.core.cycle_time_s = float(value) / 1000.0

    # ---- process sets --------------------------------------------------------------------
    def _register_set(self, set_id: int, ranks: List[int], comm: Any) -> None:
        state = self.sets.register(set_id, ranks, comm)
        if set_id == 0:
            self.algorithms = tunable_algorithms(self.config, state.topology, state.algorithm)
        flat = state.algorithm is flat_allreduce
        comm_id = _mpi_object_id(comm) if self._gloo is None else self._gloo.register(comm)
        self._comm_ids[set_id] = comm_id
        self.core.add_set(set_id, comm_id, state.rank, state.size, flat,
                          state.topology.num_nodes == 1)
        if flat:
            self._core_allreduce_sets.add(set_id)

    def _create_set(self, ranks: List[int]) -> int:
        """Collective over the global set, in the same order on every rank."""
        set_id, comm = self.sets.create(ranks)
        if comm is not None:
            self._register_set(set_id, ranks, comm)
        return set_id

    def _remove_set(self, set_id: int) -> bool:
        self._core_allreduce_sets.discard(set_id)
        removed, state = self.sets.remove(set_id)
        if not removed:
            return False
        reason = f"Process set {set_id} was removed."
        if state is not None:
            self.executor.completer.fail(state, list(state.entries), reason)
            self.executor.forget_set(set_id)
            state.topology.free()
        self.core.remove_set(set_id, reason)
        comm_id = self._comm_ids.pop(set_id, None)
        if self._gloo is not None and comm_id is not None:
            self._gloo.forget(comm_id)
        return True

    def process_set_info(self, set_id: int) -> Tuple[List[int], Optional[int], Optional[int]]:
        """(ranks, size, rank-in-set) of a registered set; rank None if not a member."""
        return self.sets.info(set_id)

    def process_set_table(self) -> Dict[int, List[int]]:
        return self.sets.table()

    def rank_in_set(self, set_id: int) -> Optional[int]:
        """This rank's rank in a set it belongs to, else None (lock-free)."""
        state = self.sets.get(set_id)
        return None if state is None else state.rank

    def find_process_set(self, ranks: List[int]) -> Optional[int]:
        return self.sets.find(ranks)

    def process_set_ids(self) -> List[int]:
        return self.sets.ids()

    def set_allreduce_algorithm(self, name: str) -> None:
        """Make ``name`` (one of :attr:`algorithms`) the global set's allreduce algorithm.
        Every rank must call it at the same point of its submissions, with none of the global
        set's allreduces in flight (autotune does so at a step boundary)."""
        algorithm = self.algorithms[name]
        self.sets.get(0).algorithm = algorithm
        # Host allreduces of a flat set run in C++; the others go to the lane.
        flat = algorithm is flat_allreduce
        if flat:
            self._core_allreduce_sets.add(0)
        else:
            self._core_allreduce_sets.discard(0)
        self.core.set_flat(0, flat)

    # ---- submission ------------------------------------------------------------------------
    def enqueue(self, set_id: int, requests: List[Request], entries: List[TensorEntry]) -> List[int]:
        """Submit requests atomically (a grouped op lands in one cycle).  Returns handles."""
        tuner = self.autotune
        if tuner is not None and set_id == 0:
            for req in requests:
                if req.op_type == OpType.ALLREDUCE:
                    tuner.on_allreduce(req.name)
        state = self.sets.get(set_id)
        flat = set_id in self._core_allreduce_sets
        tuples, lane_names = [], []
        for req, entry in zip(requests, entries):
            op = req.op_type
            # Adasum runs in Python (allreduce/adasum.py) whatever the set's algorithm.  The C++
            # thread keeps the entries of CUDA allreduces itself and hands them to the lane
            # fused, as lists (csrc/engine's GpuAllreduce); the lane holds the others'.
            if op == OpType.ALLREDUCE:
                lane = req.device < 0 and (not flat or req.reduce_op == ReduceOp.ADASUM)
            else:
                lane = req.device >= 0 or op in _LANE_OPS
            if lane and state is not None:
                # The lane reads the entry: it must be in place before the C++ thread can
                # see the request.
                if entry.name in state.entries:
                    raise ValueError(f"{hs.DUPLICATE_NAME} (tensor name: {entry.name})")
                state.entries[entry.name] = entry
                lane_names.append(entry.name)
            tuples.append((req.rank, req.name, int(op), int(req.dtype), req.shape,
                           int(req.reduce_op), float(req.prescale), float(req.postscale),
                           int(req.root), req.splits, req.payload, int(req.device),
                           entry.in_addr, entry.out_addr, lane, entry.ready_event))
        try:
            handles = self.core.enqueue(set_id, tuples)
        except BaseException as exc:
            for name in lane_names:
                state.entries.pop(name, None)
            raise _translate(exc) from None
        self._keep.update(zip(handles, entries))
        if self.timeline.active:
            for req in requests:
                self.timeline.begin(req.name, "NEGOTIATE_" + OpType(req.op_type).name)
        return handles

    def submit_allreduce(self, set_id: int, rank: int, name: str, dtype: int, shape: tuple,
                         in_addr: int, out_addr: int, reduce_op: int, prescale: float,
                         postscale: float, keep: object) -> int:
        """One allreduce of host memory (``rank``: this rank in the set); returns its handle.
        The frontends' per-tensor hot path (what ``DistributedOptimizer`` submits per
        gradient): scalars rather than :meth:`submit_allreduces`' lists, which would cost a
        tenth of the call.  ``keep`` stays referenced until the handle is waited on."""
        if set_id not in self._core_allreduce_sets or reduce_op == ReduceOp.ADASUM or \
                self.autotune is not None:
            return self.submit_allreduces(set_id, rank, [name], [dtype], [shape], [in_addr],
                                          [out_addr], reduce_op, prescale, postscale, keep)[0]
        try:
            hid = self.core.enqueue_allreduce(set_id, rank, name, dtype, shape, in_addr,
                                              out_addr, reduce_op, prescale, postscale)
        except BaseException as exc:
            raise _translate(exc) from None
        self._keep[hid] = keep
        if self.timeline.active:
            self.timeline.begin(name, "NEGOTIATE_ALLREDUCE")
        return hid

    def submit_allreduces(self, set_id: int, rank: int, names: List[str], dtypes: List[int],
                          shapes: List[tuple], ins: List[int], outs: List[int],
                          reduce_op: int, prescale: float, postscale: float, keep: object,
                          device: int = -1, ready_event: int = 0) -> List[int]:
        """The allreduces of one call (``rank``: this rank in the set), one list per field;
        returns their handles (:meth:`submit_allreduce` for one host tensor).  No
        Request/TensorEntry objects are built unless the lane runs them (host tensors of a set
        without the flat algorithm, Adasum).  CUDA tensors (``device`` >= 0) wait for
        ``ready_event``, recorded on the producer's stream.  ``keep`` stays referenced until
        the handles are waited on."""
        tuner = self.autotune
        if tuner is not None and set_id == 0:
            for name in names:
                tuner.on_allreduce(name)
        if device < 0 and (set_id not in self._core_allreduce_sets or reduce_op == ReduceOp.ADASUM):
            # The lane runs them (hierarchical algorithm, Adasum), or enqueue raises the usual
            # error.
            requests = [Request(rank, n, OpType.ALLREDUCE, dt, shape, reduce_op, prescale,
                                postscale) for n, dt, shape in zip(names, dtypes, shapes)]
            entries = [TensorEntry(n, dt, shape, i, o)
                       for n, dt, shape, i, o in zip(names, dtypes, shapes, ins, outs)]
            entries[0].keep = keep
            return self.enqueue(set_id, requests, entries)
        try:
            handles = self.core.enqueue_allreduces(set_id, rank, names, dtypes, shapes, ins,
                                                   outs, reduce_op, prescale, postscale, device,
                                                   ready_event)
        except BaseException as exc:
            raise _translate(exc) from None
        self._keep[handles[0]] = keep
        if self.timeline.active:
            for name in names:
                self.timeline.begin(name, "NEGOTIATE_ALLREDUCE")
        return handles

    def run_control(self, set_id: int, op_type: OpType, name: str, payload=None):
        """Submit one control request (join, barrier, process-set changes) and wait for its
        result."""
        rank = self.rank_in_set(set_id)
        if rank is None:
            raise ValueError(hs.NOT_IN_PROCESS_SET)
        req = Request(rank, name, op_type, payload=payload)
        (handle,) = self.enqueue(set_id, [req], [TensorEntry(name, 0, (), 0)])
        return self.wait(handle).result

    # ---- completion ------------------------------------------------------------------------
    def poll(self, handle: int) -> bool:
        state = self.core.poll(handle)
        if state < 0:
            raise unknown_handle(handle)
        return state == 1

    def _wait(self, handle: int):
        """(result, completion event) of ``handle``, once it completed; then forgotten."""
        try:
            result, event = self.core.wait(handle)
        except IndexError:
            self._forget(handle)
            raise unknown_handle(handle) from None
        except native.EngineStopped as exc:
            self._forget(handle)
            raise collective_error(str(exc)) from None
        self._keep.pop(handle, None)
        if self.results:  # only lane-executed ops leave a Python result here
            lane_result = self.results.pop(handle, None)
            if lane_result is not None:
                result = lane_result
        return result, event

    def _forget(self, handle: int) -> None:
        self._keep.pop(handle, None)
        self.results.pop(handle, None)

    def wait(self, handle: int) -> WaitResult:
        """Block until the handle completes, then forget it.  Raises on failure."""
        return WaitResult(*self._wait(handle))

    def wait_result(self, handle: int):
        """:meth:`wait`, returning only the handle's result (the frontends' hot path)."""
        return self._wait(handle)[0]

    def wait_all(self, handles: List[int]) -> Tuple[List[Any], List[int]]:
        """Wait for every handle of one call and forget them all: (results, completion
        events), one per handle.  Raises the first failure, once all are done."""
        try:
            results, events = self.core.wait_all(handles)
        except IndexError as exc:
            for h in handles:
                self._forget(h)
            raise unknown_handle(int(str(exc))) from None
        except native.EngineStopped as exc:
            for h in handles:
                self._forget(h)
            raise collective_error(str(exc)) from None
        keep = self._keep
        for h in handles:
            keep.pop(h, None)
        if self.results:  # only lane-executed ops leave a Python result here
            for i, h in enumerate(handles):
                lane_result = self.results.pop(h, None)
                if lane_result is not None:
                    results[i] = lane_result
        return results, events

    def wait_any(self, handles: Sequence[int], timeout: Optional[float] = None) -> List[int]:
        """Block until at least one of ``handles`` completes; return all that have, in the
        order given.  They stay registered: :meth:`wait` then returns their results without
        blocking.  ``[]`` when ``handles`` is empty or ``timeout`` passes first."""
        try:
            return self.core.wait_any(list(handles), -1.0 if timeout is None else timeout)
        except IndexError as exc:
            raise unknown_handle(int(str(exc))) from None
        except BaseException as exc:
            raise _translate(exc) from None

    def handle_event(self, handle: int) -> int:
        """The completion cudaEvent_t of a done GPU handle (0 for host ops or in flight)."""
        return self.core.event(handle)

    def completion_time(self, handle: int) -> Optional[float]:
        """``time.monotonic()`` when a still-registered handle completed; None while it is
        in flight or once :meth:`wait` has cleared it."""
        return self.core.completion_time(handle)

    # ---- read-only counters (leak checks) -------------------------------------------------
    def open_handles(self) -> int:
        """Handles submitted and not yet cleared by :meth:`wait`: operations in flight plus
        completed ones nobody waited for."""
        return self.core.counts()["open_handles"]

    def counts(self) -> Dict[str, int]:
        """Sizes of the engine's tables (open handles, entries, negotiation tables, process
        sets, fusion buffer bytes, timeline tensors).  In steady state none of them grows with
        the number of steps; a long run that sees one grow has found a leak."""
        out = dict(self.core.counts())
        out["foreign_process_sets"] = self.sets.foreign_count()
        out["fusion_buffer_bytes"] += self.executor.host.fusion_buffer_bytes
        out["timeline_tensors"] = self.timeline.tensor_count
        return out

    def in_flight(self) -> Dict[int, List[Tuple[str, int]]]:
        """(name, bytes) of the tensors submitted and not yet completed, by process set:
        what the watchdog reports when it fires.  Read from another thread."""
        out: Dict[int, List[Tuple[str, int]]] = {}
        for set_id, name, nbytes in self.core.in_flight():
            out.setdefault(set_id, []).append((name, nbytes))
        return out

    # ---- the lane ------------------------------------------------------------------------
    def _lane(self, kind: str, set_id: int, payload) -> Union[None, str, int]:
        """Called by the C++ thread, with the GIL, for what needs Python (module doc).
        Returns a failure message to stop the engine with, None, or for "gpu_allreduce" the
        fused response's completion event."""
        try:
            if kind == "execute":
                state = self.sets.get(set_id)
                responses = [Response(OpType(t[0]), *t[1:]) for t in payload]
                self.executor.execute(state, responses)
            elif kind == "gpu_allreduce":  # returns the completion event
                return self.executor.gpu_allreduce(self.sets.get(set_id), payload)
            elif kind == "timeline":
                timeline = self.timeline
                for name, activity, ts in payload:
                    if not name:
                        timeline.mark_cycle(ts)
                    elif activity:
                        timeline.begin(name, activity, ts=ts)
                    else:
                        timeline.end(name, ts=ts)
            elif kind == "stall":
                log.warning("%s\n%s", hs.STALL_WARNING.format(
                    seconds=int(self.config.stall_check_time_s)), payload)
            elif kind == "fatal":
                log.error("aiak_training background thread failed: %s", payload)
                return payload + (self.watchdog.lost_peers_note() if self.watchdog else "")
            return None
        except BaseException as exc:  # noqa: BLE001 - every pending op must learn about it
            log.exception("aiak_training background thread failed")
            reason = f"The background thread failed: {type(exc).__name__}: {exc}"
            if self.watchdog is not None:
                # An MPI error usually means a peer vanished: name the ones that are gone.
                reason += self.watchdog.lost_peers_note()
            self.failure = reason
            return reason

    def _run_control(self, state: SetState, resp: Response) -> None:
        """Carry out a negotiated process-set change in the lane, in response order (they
        are collectives over the global set)."""
        result = None
        if resp.op_type == OpType.ADD_PROCESS_SET:
            result = self._create_set(list(resp.payload))
        elif resp.op_type == OpType.REMOVE_PROCESS_SET:
            result = self._remove_set(resp.payload[0])
        self.executor.completer.finish(state, [resp], result=result)
