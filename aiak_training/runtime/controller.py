"""Negotiation: decide, identically on every rank of a process set, which tensors are ready.

One controller per process set.  Each cycle:

1. New requests are classified against the response cache (HIT / MISS / INVALID).
2. One bitwise-AND allreduce of a small uint64 vector carries three things at once: status
   flags and invalidated bits (stored inverted, so AND gives OR), and cache-hit bits (AND gives
   "ready on every rank").  In steady state this is the only communication.
3. Only if some rank has uncached requests, has joined, or wants a stall report, the
   coordinator (rank 0 of the set) gathers the requests, checks that they agree, and
   broadcasts the ready responses (or errors naming the tensor).

Every rank then executes cached responses (ascending bit) followed by the coordinator's, in
that order, so collectives are always issued in the same order everywhere.
"""
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
from mpi4py import MPI

from aiak_training.common import horovod_strings as hs
from aiak_training.common.dtypes import DataType, ReduceOp
from aiak_training.common.messages import CONTROL_OPS, OpType, Request, Response
from aiak_training.runtime.response_cache import HIT, INVALID, ResponseCache

log = logging.getLogger("aiak_training")

FLAG_SHUTDOWN = 1
FLAG_UNCACHED = 2
FLAG_JOINED = 4
FLAG_STALL = 8
_ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)

# Ops whose tensors must have identical shapes on every rank.
_SAME_SHAPE_OPS = frozenset({OpType.ALLREDUCE, OpType.BROADCAST, OpType.REDUCESCATTER})
# Ops a joined rank cannot take part in (it has no data to contribute).
_NO_JOIN_OPS = frozenset({OpType.ALLGATHER, OpType.BROADCAST, OpType.ALLTOALL})

_OP_WORD = {OpType.ALLREDUCE: "allreduce", OpType.ALLGATHER: "allgather",
            OpType.BROADCAST: "broadcast", OpType.ALLTOALL: "alltoall",
            OpType.REDUCESCATTER: "reducescatter", OpType.BARRIER: "barrier",
            OpType.JOIN: "join", OpType.ADD_PROCESS_SET: "add_process_set",
            OpType.REMOVE_PROCESS_SET: "remove_process_set"}


def _dtype_name(code: int) -> str:
    return DataType(code).name.lower()


def _shape_str(shape: Tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass
class NegotiationResult:
    responses: List[Response] = field(default_factory=list)
    shutdown: bool = False
    shutdown_reason: str = ""


class Controller:
    """Negotiation state of one process set on this rank."""

    def __init__(self, comm: MPI.Comm, cache_capacity: int, stall_check_s: float,
                 stall_shutdown_s: float):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.cache = ResponseCache(cache_capacity)
        self.words = max(1, (cache_capacity + 63) // 64)
        self.stall_check_s = stall_check_s
        self.stall_shutdown_s = stall_shutdown_s
        if 0 < stall_shutdown_s < stall_check_s:
            # As Horovod: a shutdown time below the warning time is ignored, with a warning.
            log.warning(hs.STALL_SHUTDOWN_BELOW_WARNING)
            self.stall_shutdown_s = 0.0
        self._cached_pending: Dict[int, Request] = {}   # bit -> request waiting on other ranks
        self._to_send: List[Request] = []               # requests for the coordinator
        self._submitted_at: Dict[str, float] = {}       # name -> when this rank submitted it
        self._last_stall_report = time.monotonic()
        self._joined = False                            # this rank called join()
        # Coordinator state (rank 0 of the set only).
        self._table: Dict[str, Dict[int, Request]] = {}
        self._joined_ranks: Set[int] = set()
        self._last_joined = -1
        self._cache_switch: Optional[bool] = None  # autotune's request, taken next cycle

    def request_cache(self, on: bool) -> None:
        """Switch the response cache on or off from the next negotiation (called by autotune
        on the training thread at a step boundary, before it submits the step's first
        tensor: that tensor and every later one are classified under the new state)."""
        self._cache_switch = on

    # ---------------------------------------------------------------------------------------
    def negotiate(self, new_requests: List[Request], want_shutdown: bool,
                  shutdown_reason: str = "") -> NegotiationResult:
        now = time.monotonic()
        switch, self._cache_switch = self._cache_switch, None
        if switch is not None:
            # At a step boundary nothing of the set is pending; the cache is emptied when
            # it goes off, so a leftover hit would point at nothing: negotiate it instead.
            if not switch:
                self._to_send.extend(self._cached_pending.pop(b)
                                     for b in sorted(self._cached_pending))
            self.cache.set_active(switch)
        invalid_bits: List[int] = []
        for req in new_requests:
            self._submitted_at[req.name] = now
            if req.op_type == OpType.JOIN:
                self._joined = True
            if req.op_type in CONTROL_OPS or not self.cache.enabled:
                self._to_send.append(req)
                continue
            state, bit = self.cache.lookup(req)
            if state == HIT:
                self._cached_pending[bit] = req
            else:
                if state == INVALID:
                    invalid_bits.append(bit)
                self._to_send.append(req)

        flags = 0
        if want_shutdown:
            flags |= FLAG_SHUTDOWN
        if self._to_send:
            flags |= FLAG_UNCACHED
        if self._joined:
            flags |= FLAG_JOINED
        stall_names = self._stalled_names(now)
        if stall_names is not None:
            flags |= FLAG_STALL
            if self.stall_shutdown_s > 0 and self._oldest_age(now) > self.stall_shutdown_s:
                flags |= FLAG_SHUTDOWN
                shutdown_reason = shutdown_reason or "stalled tensors exceeded " \
                    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"

        vec = self._bit_vector(flags, invalid_bits)
        self.comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.BAND)
        g_flags = int(~vec[0] & _ALL_ONES)
        result = NegotiationResult()
        if g_flags & FLAG_SHUTDOWN:
            result.shutdown = True
            result.shutdown_reason = shutdown_reason or "another rank shut down"
            return result

        for bit in self._bits(~vec[1:1 + self.words] & _ALL_ONES):
            # Renegotiate a tensor whose cached response no longer matches on some rank.
            req = self._cached_pending.pop(bit, None)
            if req is not None:
                self._to_send.append(req)
            self.cache.evict(bit)
        if g_flags & FLAG_JOINED:
            # A joined rank contributes zeros: that needs full negotiation, not the cache.
            for bit in sorted(self._cached_pending):
                self._to_send.append(self._cached_pending.pop(bit))

        for bit in self._bits(vec[1 + self.words:]):
            if bit in self._cached_pending:
                req = self._cached_pending.pop(bit)
                self.cache.touch(bit)
                result.responses.append(self.cache.response(bit))

        if g_flags & (FLAG_UNCACHED | FLAG_JOINED | FLAG_STALL):
            # On a stall report every rank lists what it waits for, not only the rank that
            # noticed, so the coordinator can tell who is really missing.
            report = sorted(self._submitted_at) if g_flags & FLAG_STALL else None
            result.responses.extend(self._coordinate(report))
        for resp in result.responses:
            for name in resp.names:
                self._submitted_at.pop(name, None)
        return result

    def record_executed(self, response: Response, signature: Optional[tuple]) -> None:
        """Cache a response that just ran (same call order on every rank)."""
        if response.error or response.joined_ranks:
            return
        evicted = self.cache.put(response, signature)
        req = self._cached_pending.pop(evicted, None) if evicted is not None else None
        if req is not None:
            self._to_send.append(req)

    def mark_unjoined(self) -> None:
        self._joined = False

    def counts(self) -> Dict[str, int]:
        """Sizes of this set's negotiation tables, for leak checks in long runs.  Read from
        another thread without a lock: each figure is one ``len``, so it may be a cycle old
        but never torn."""
        return {"cache_entries": len(self.cache),
                "cached_pending": len(self._cached_pending),
                "uncached_pending": len(self._to_send),
                "submitted_pending": len(self._submitted_at),
                "coordinator_table": len(self._table)}

    # ---------------------------------------------------------------------------------------
    def _bit_vector(self, flags: int, invalid_bits: List[int]) -> np.ndarray:
        # Built with Python ints (cheap per bit), converted to uint64 once.
        mask = (1 << 64) - 1
        invalid = [0] * self.words
        for bit in invalid_bits:
            invalid[bit >> 6] |= 1 << (bit & 63)
        hits = [0] * self.words
        for bit in self._cached_pending:
            hits[bit >> 6] |= 1 << (bit & 63)
        return np.array([~flags & mask] + [~w & mask for w in invalid] + hits, dtype=np.uint64)

    @staticmethod
    def _bits(words: np.ndarray) -> List[int]:
        out = []
        for w, word in enumerate(words.tolist()):
            while word:
                low = word & -word
                out.append(w * 64 + low.bit_length() - 1)
                word ^= low
        return out

    def _oldest_age(self, now: float) -> float:
        return max((now - t for t in self._submitted_at.values()), default=0.0)

    def _stalled_names(self, now: float) -> Optional[List[str]]:
        """Names to report, once per stall-check period, if something waits too long."""
        if self.stall_check_s <= 0 or now - self._last_stall_report < self.stall_check_s:
            return None
        if self._oldest_age(now) < self.stall_check_s:
            return None
        self._last_stall_report = now
        return sorted(self._submitted_at)

    # ---------------------------------------------------------------------------------------
    def _coordinate(self, stall_names: Optional[List[str]]) -> List[Response]:
        payload = (self._to_send, stall_names)
        self._to_send = []
        gathered = self.comm.gather(payload, root=0)
        responses = None
        if self.rank == 0:
            responses = self._plan(gathered)
        return self.comm.bcast(responses, root=0)

    def _plan(self, gathered: List[Tuple[List[Request], Optional[List[str]]]]) -> List[Response]:
        responses: List[Response] = []
        for rank, (requests, _) in enumerate(gathered):
            for req in requests:
                if req.op_type == OpType.JOIN:
                    self._joined_ranks.add(rank)
                    self._last_joined = rank
                    continue
                self._table.setdefault(req.name, {})[rank] = req
        stall_lists = [names for _, names in gathered]
        if any(names is not None for names in stall_lists):
            self._report_stall(stall_lists)

        everyone = set(range(self.size))
        for name in list(self._table):
            reqs = self._table[name]
            first = reqs[min(reqs)]
            if first.op_type in CONTROL_OPS:
                ready = set(reqs) == everyone or \
                    (first.op_type == OpType.BARRIER and set(reqs) | self._joined_ranks == everyone)
            else:
                ready = set(reqs) | self._joined_ranks == everyone
            if ready:
                del self._table[name]
                responses.append(self._construct(name, reqs))
        if self._joined_ranks == everyone:
            responses.append(Response(OpType.JOIN, ["join"], last_joined=self._last_joined))
            self._joined_ranks = set()
        return responses

    def _report_stall(self, stall_lists: List[Optional[List[str]]]) -> None:
        pending = {r: set(n or ()) for r, n in enumerate(stall_lists)}
        waiting = set().union(*pending.values())
        missing: Dict[int, List[str]] = {}
        for name in sorted(waiting):
            for r in range(self.size):
                if name not in pending[r] and r not in self._joined_ranks:
                    missing.setdefault(r, []).append(name)
        if not missing:
            return
        lines = "\n".join(f"{r}: [{', '.join(names)}]" for r, names in sorted(missing.items()))
        log.warning("%s\n%s", hs.STALL_WARNING.format(seconds=int(self.stall_check_s)), lines)

    def _construct(self, name: str, reqs: Dict[int, Request]) -> Response:
        ranks = sorted(reqs)
        first = reqs[ranks[0]]
        op = first.op_type

        def error(msg: str) -> Response:
            return Response(OpType.ERROR, [name], error=msg)

        for r in ranks[1:]:
            other = reqs[r]
            if other.op_type != op:
                return error(f"Mismatched operations on tensor {name}: one or more ranks did "
                             f"an {_OP_WORD[op]}, and one or more ranks did an "
                             f"{_OP_WORD[other.op_type]}.")
        if op in (OpType.ADD_PROCESS_SET, OpType.REMOVE_PROCESS_SET):
            if any(reqs[r].payload != first.payload for r in ranks):
                return error(f"Mismatched {_OP_WORD[op]} request {name}: ranks passed different "
                             "process sets.")
            return Response(op, [name], payload=first.payload)
        if op == OpType.BARRIER:
            return Response(op, [name])

        for r in ranks[1:]:
            other = reqs[r]
            if other.dtype != first.dtype:
                return error(f"Mismatched data types on tensor {name}: one rank had type "
                             f"{_dtype_name(first.dtype)}, but another rank had type "
                             f"{_dtype_name(other.dtype)}.")
            if op in _SAME_SHAPE_OPS and other.shape != first.shape:
                return error(f"Mismatched {_OP_WORD[op]} tensor shapes on tensor {name}: one "
                             f"rank sent a tensor of shape {_shape_str(first.shape)}, but another "
                             f"rank sent a tensor of shape {_shape_str(other.shape)}.")
            if op in (OpType.ALLGATHER, OpType.ALLTOALL):
                if len(other.shape) != len(first.shape):
                    return error(f"Mismatched {_OP_WORD[op]} tensor shapes on tensor {name}: "
                                 f"one rank sent a tensor of rank {len(first.shape)}, but another "
                                 f"rank sent a tensor of rank {len(other.shape)}.")
                if other.shape[1:] != first.shape[1:]:
                    return error(f"Mismatched {_OP_WORD[op]} tensor shapes on tensor {name}: "
                                 f"one rank sent a tensor of shape {_shape_str(first.shape)}, but "
                                 f"another rank sent a tensor of shape {_shape_str(other.shape)} "
                                 "(only the first dimension may differ).")
            if (other.device >= 0) != (first.device >= 0):
                return error(f"Mismatched {_OP_WORD[op]} CPU/GPU device selection on tensor "
                             f"{name}: one rank specified device "
                             f"{'GPU' if first.device >= 0 else 'CPU'}, but another rank "
                             f"specified device {'GPU' if other.device >= 0 else 'CPU'}.")
            if other.reduce_op != first.reduce_op:
                return error(f"Mismatched reduction operations on tensor {name}: one rank used "
                             f"{ReduceOp(first.reduce_op).name}, but another rank used "
                             f"{ReduceOp(other.reduce_op).name}.")
            if other.prescale != first.prescale or other.postscale != first.postscale:
                return error(f"Mismatched prescale and/or postscale factors on tensor {name}: "
                             f"({first.prescale}, {first.postscale}) versus "
                             f"({other.prescale}, {other.postscale}).")
            if op == OpType.BROADCAST and other.root != first.root:
                return error(f"Mismatched broadcast root ranks on tensor {name}: one rank "
                             f"specified root rank {first.root}, but another rank specified "
                             f"root rank {other.root}.")
        joined = tuple(sorted(r for r in range(self.size) if r not in reqs))
        if joined and op in _NO_JOIN_OPS:
            return error(f"Tensor {name}: {_OP_WORD[op]} is not supported while ranks "
                         f"{list(joined)} have joined (hvd.join).")
        shapes = [[reqs[r].shape if r in reqs else first.shape for r in range(self.size)]]
        splits = None
        if op == OpType.ALLTOALL:
            splits = [reqs[r].splits for r in range(self.size)]
        return Response(op, [name], dtype=first.dtype, shapes=shapes, reduce_op=first.reduce_op,
                        prescale=first.prescale, postscale=first.postscale, root=first.root,
                        splits=splits, joined_ranks=joined, gpu=first.device >= 0)
