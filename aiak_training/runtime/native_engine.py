"""The engine with its background loop in C++ (csrc/engine/): the default engine.

The native thread owns the queues, negotiation (bit vectors, response cache, coordinator),
fusion and the transport calls of host allreduce and broadcast, and completes handles.  Over
MPI it never takes the GIL for them, so a busy training thread cannot slow a reduction down,
and a tensor costs the Python frontend only its submit and wait.  Over Gloo each transport
call is a call into :class:`~aiak_training.runtime.transport.gloo_calls.GlooCalls`, with the
GIL held for that call only.

What needs Python runs in the *lane*: the native thread calls :meth:`NativeEngine._lane`
with the GIL, in the negotiated order, for GPU collectives, allgather, alltoall and
reducescatter (their results are allocated by the frontend), process-set changes, the
hierarchical allreduce algorithms, timeline events and stall warnings.  The lane reuses the
Python engine's executor, so those paths behave exactly as in :class:`Engine`, of which this
is a subclass: process sets, topology, watchdog and lifecycle are shared.

``AIAK_ENGINE=python`` selects the Python engine instead (kept for one release).
"""
import logging
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from mpi4py import MPI

from aiak_training.allreduce.flat import flat_allreduce
from aiak_training.common import horovod_strings as hs
from aiak_training.common import native
from aiak_training.common.dtypes import DataType, ReduceOp, mpi_datatype
from aiak_training.common.exceptions import HorovodInternalError
from aiak_training.common.messages import OpType, Request, Response
from aiak_training.runtime.completion import Completer
from aiak_training.runtime.engine import Engine
from aiak_training.runtime.entries import Handle, SetState, TensorEntry, unknown_handle
from aiak_training.runtime.transport import transport_name

if TYPE_CHECKING:
    from aiak_training.runtime.transport.gloo_calls import GlooCalls

log = logging.getLogger("aiak_training")

# Ops the native thread hands to the lane whatever the tensor's device.
_LANE_OPS = frozenset({OpType.ALLGATHER, OpType.ALLTOALL, OpType.REDUCESCATTER,
                       OpType.ADD_PROCESS_SET, OpType.REMOVE_PROCESS_SET})


def _handle(obj) -> int:
    """An MPI handle's value as a signed 64-bit int (mpi4py reports it unsigned)."""
    value = MPI._handleof(obj)
    return value - (1 << 64) if value >= 1 << 63 else value


def _mpi_handles() -> dict:
    """Handles of the MPI objects the native engine uses, from mpi4py (see csrc/engine/mpi.h)."""
    handle = _handle
    ops = {"SUM": MPI.SUM, "MIN": MPI.MIN, "MAX": MPI.MAX, "PROD": MPI.PROD, "LOR": MPI.LOR,
           "LAND": MPI.LAND, "BAND": MPI.BAND}
    out = {name: handle(op) for name, op in ops.items()}
    out.update(
        handle_bytes=MPI._sizeof(MPI.COMM_WORLD), in_place=int(MPI.IN_PLACE),
        UINT64_T=handle(MPI.UINT64_T), INT32_T=handle(MPI.INT32_T), INT64_T=handle(MPI.INT64_T),
        BYTE=handle(MPI.BYTE), dtypes=[handle(mpi_datatype(DataType(code))) for code in range(11)])
    return out


def _core_config(config, gloo: Optional["GlooCalls"]) -> dict:
    """The native engine's settings, with the handles of its transport's objects."""
    out = _mpi_handles() if gloo is None else gloo.config()
    out.update(
        cycle_time_s=config.cycle_time_ms / 1000.0, cache_capacity=config.cache_capacity,
        stall_check_s=0.0 if config.stall_check_disable else config.stall_check_time_s,
        stall_shutdown_s=config.stall_shutdown_time_s,
        # The idle park saves Gloo jobs the CPU of idle negotiations (each one a Python call
        # and a Gloo round trip); MPI jobs keep their steady cycle.
        idle_park_s=0.0 if gloo is None else config.idle_park_ms / 1000.0,
        shut_down=hs.SHUT_DOWN, duplicate_name=hs.DUPLICATE_NAME)
    return out


class _LaneCompleter(Completer):
    """Completes lane-executed tensors in the native handle table.  The result (a Python
    object) is stored before the handle is marked done, so a waiter always finds it."""

    def __init__(self, engine: "NativeEngine"):
        super().__init__(None, engine.timeline)
        self._engine = engine

    def finish(self, state: SetState, responses: List[Response], result=None,
               events: Optional[Dict[str, int]] = None) -> None:
        core, timeline = self._engine.core, self.timeline
        for resp in responses:
            for name in resp.names:
                entry = state.entries.pop(name, None)
                if timeline.active:
                    timeline.end(name)
                if entry is None:
                    continue
                if result is not None:
                    self._engine.results[core.handle_of(state.id, name)] = result
                core.finish_name(state.id, name, "", events.get(name, 0) if events else 0)

    def fail(self, state: SetState, names: Sequence[str], error: str) -> None:
        for name in names:
            if state.entries.pop(name, None) is not None:
                self._engine.core.finish_name(state.id, name, error, 0)

    def notify(self) -> None:
        pass  # the native thread wakes waiters when the lane returns


class NativeEngine(Engine):
    kind = "native"

    def __init__(self, comm: MPI.Comm, config, static_process_sets: Sequence[Sequence[int]] = ()):
        super().__init__(comm, config, static_process_sets)
        # Gloo jobs: the C++ thread's collectives call torch's Gloo groups through Python.
        self._gloo: Optional["GlooCalls"] = None
        if transport_name(comm) == "gloo":
            from aiak_training.runtime.transport.gloo_calls import GlooCalls
            self._gloo = GlooCalls()
        self._comm_handles: Dict[int, int] = {}  # set id -> the core's handle of its comm
        self.core = native.EngineCore(_core_config(config, self._gloo), self._lane, self._gloo)
        self.core.fusion_threshold = config.fusion_threshold
        self.core.zero_copy_bytes = config.zero_copy_bytes
        self.results: Dict[int, object] = {}   # handle -> result of a lane-executed op
        self._keep: Dict[int, object] = {}     # handle -> memory the op uses
        self._flat_sets = set()                # sets whose host allreduce runs natively
        self._completer = _LaneCompleter(self)
        self.executor.completer = self._completer
        self.timeline.on_active = self._timeline_changed
        config.on_change = self._config_changed

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, timeout: Optional[float] = None) -> None:
        ok = self._initialize()  # on this thread: the native loop starts after it
        if not ok:
            raise ValueError(f"Horovod initialization failed: {self._init_error}") \
                from self._init_error
        self.core.timeline_on = self.timeline.active
        self.core.start()
        if self.watchdog is not None:
            self.watchdog.start()

    def shutdown(self) -> None:
        if self.watchdog is not None and self.watchdog.fired:
            self.watchdog.exit_process()  # the native thread is stuck inside MPI
        if self._stopped:
            return
        self._end_autotune()
        self.core.request_shutdown()
        self.core.join()
        self._stopped = True
        if self.watchdog is not None:
            self.watchdog.close()
        fatal = self.core.fatal() or None
        self._fatal = self._fatal or fatal
        self._release(clean=self._fatal is None)

    @property
    def running(self) -> bool:
        return self._ready.is_set() and self.core.running

    @property
    def thread_ident(self) -> Optional[int]:
        return None  # a native thread: no Python stack to show

    @property
    def cycle_started(self) -> float:  # type: ignore[override]
        return self.core.cycle_started

    @cycle_started.setter
    def cycle_started(self, value: float) -> None:
        pass  # written by the native thread only

    def abandon(self, reason: str) -> None:
        self._fatal = reason
        # MPI may still write into these tensors if the stuck call returns: keep them.
        self._abandoned.extend(self._keep.values())
        self.core.abandon(reason)

    def _timeline_changed(self, active: bool) -> None:
        self.core.timeline_on = active

    def _config_changed(self, field: str, value) -> None:
        if field in ("fusion_threshold", "zero_copy_bytes"):
            setattr(self.core, field, int(value))
        elif field == "cycle_time_ms":
            self.core.cycle_time_s = float(value) / 1000.0

    # ---- process sets --------------------------------------------------------------------
    def _register_set(self, set_id: int, ranks: List[int], comm: MPI.Comm) -> None:
        super()._register_set(set_id, ranks, comm)
        state = self._sets[set_id]
        flat = state.algorithm is flat_allreduce
        handle = _handle(comm) if self._gloo is None else self._gloo.register(comm)
        self._comm_handles[set_id] = handle
        self.core.add_set(set_id, handle, state.rank, state.size, flat)
        if flat:
            self._flat_sets.add(set_id)

    def set_allreduce_algorithm(self, name: str) -> None:
        super().set_allreduce_algorithm(name)
        # Host allreduces of a flat set run in C++; the others go to the lane.
        flat = self._sets[0].algorithm is flat_allreduce
        if flat:
            self._flat_sets.add(0)
        else:
            self._flat_sets.discard(0)
        self.core.set_flat(0, flat)

    def _remove_set(self, set_id: int) -> bool:
        self._flat_sets.discard(set_id)
        removed = super()._remove_set(set_id)
        if removed:
            self.core.remove_set(set_id, f"Process set {set_id} was removed.")
            handle = self._comm_handles.pop(set_id, None)
            if self._gloo is not None and handle is not None:
                self._gloo.forget(handle)
        return removed

    # ---- submission and completion -------------------------------------------------------
    def _enqueue(self, set_id: int, requests: List[Request],
                 entries: List[TensorEntry]) -> List[int]:
        state = self._sets.get(set_id)
        flat = set_id in self._flat_sets
        tuples, lane_names = [], []
        for req, entry in zip(requests, entries):
            op = req.op_type
            # Adasum runs in Python (allreduce/adasum.py) whatever the set's algorithm.
            lane = req.device >= 0 or op in _LANE_OPS or (
                op == OpType.ALLREDUCE and (not flat or req.reduce_op == ReduceOp.ADASUM))
            if lane and state is not None:
                # The lane reads the entry: it must be in place before the native thread can
                # see the request.
                if entry.name in state.entries:
                    raise ValueError(f"{hs.DUPLICATE_NAME} (tensor name: {entry.name})")
                state.entries[entry.name] = entry
                lane_names.append(entry.name)
            tuples.append((req.rank, req.name, int(op), int(req.dtype), req.shape,
                           int(req.reduce_op), float(req.prescale), float(req.postscale),
                           int(req.root), req.splits, req.payload, int(req.device),
                           entry.in_addr, entry.out_addr, lane))
        try:
            handles = self.core.enqueue(set_id, tuples)
        except BaseException as exc:
            for name in lane_names:
                state.entries.pop(name, None)
            raise self._translate(exc) from None
        for hid, entry in zip(handles, entries):
            entry.handle = hid
            self._keep[hid] = entry
        self._trace_submitted(requests)
        return handles

    def _submit_allreduce(self, set_id: int, rank: int, name: str, dtype: int, shape: tuple,
                          in_addr: int, out_addr: int, reduce_op: int, prescale: float,
                          postscale: float, keep: object) -> int:
        if set_id not in self._flat_sets or reduce_op == ReduceOp.ADASUM:
            # The lane runs it (hierarchical algorithm, Adasum), or enqueue raises the usual
            # error.
            return super()._submit_allreduce(set_id, rank, name, dtype, shape, in_addr,
                                             out_addr, reduce_op, prescale, postscale, keep)
        try:
            hid = self.core.enqueue_allreduce(set_id, rank, name, dtype, shape, in_addr,
                                              out_addr, reduce_op, prescale, postscale)
        except BaseException as exc:
            raise self._translate(exc) from None
        self._keep[hid] = keep
        if self.timeline.active:
            self.timeline.begin(name, "NEGOTIATE_ALLREDUCE")
        return hid

    @staticmethod
    def _translate(exc: BaseException) -> BaseException:
        if isinstance(exc, native.EngineStopped):
            return HorovodInternalError(str(exc))
        if isinstance(exc, native.BadRequest):
            return ValueError(str(exc))
        return exc

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
            raise HorovodInternalError(str(exc)) from None
        self._keep.pop(handle, None)
        if self.results:  # only lane-executed ops leave a Python result here
            lane_result = self.results.pop(handle, None)
            if lane_result is not None:
                result = lane_result
        return result, event

    def _forget(self, handle: int) -> None:
        self._keep.pop(handle, None)
        self.results.pop(handle, None)

    def wait(self, handle: int) -> Handle:
        h = Handle()
        h.result, h.event = self._wait(handle)
        h.done = True
        return h

    def wait_result(self, handle: int):
        return self._wait(handle)[0]

    def wait_any(self, handles: Sequence[int], timeout: Optional[float] = None) -> List[int]:
        try:
            return self.core.wait_any(list(handles), -1.0 if timeout is None else timeout)
        except IndexError as exc:
            raise unknown_handle(int(str(exc))) from None
        except BaseException as exc:
            raise self._translate(exc) from None

    def handle_event(self, handle: int) -> int:
        return self.core.event(handle)

    def completion_time(self, handle: int) -> Optional[float]:
        return self.core.completion_time(handle)

    def open_handles(self) -> int:
        return self.core.counts()["open_handles"]

    def counts(self) -> Dict[str, int]:
        out = dict(self.core.counts())
        with self._lock:
            out["foreign_process_sets"] = len(self._foreign_sets)
        out["fusion_buffer_bytes"] += self.executor.fusion_buffer_bytes
        out["timeline_tensors"] = self.timeline.tensor_count
        return out

    def in_flight(self) -> Dict[int, List[Tuple[str, int]]]:
        out: Dict[int, List[Tuple[str, int]]] = {}
        for set_id, name, nbytes in self.core.in_flight():
            out.setdefault(set_id, []).append((name, nbytes))
        return out

    # ---- the lane ------------------------------------------------------------------------
    def _lane(self, kind: str, set_id: int, payload) -> Optional[str]:
        """Called by the native thread, with the GIL, for what needs Python (module doc).
        Returns a failure message to stop the engine with, or None."""
        try:
            if kind == "execute":
                state = self._sets.get(set_id)
                responses = [Response(OpType(t[0]), *t[1:]) for t in payload]
                self.executor.execute(state, responses)
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
            return self._failed(exc)
