"""The runtime's shared data: tensor entries, completion handles, per-process-set state.

The engine, the CPU executor and the GPU executor all work on these types; keeping them
here, below all three, lets each of those modules import only what it uses.
"""
import threading
import time
from dataclasses import dataclass, field
from itertools import count as _counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mpi4py import MPI

from aiak_training.common.dtypes import ITEMSIZE, DataType
from aiak_training.common.exceptions import HorovodInternalError
from aiak_training.common.messages import Request
from aiak_training.common.topology import Topology


class TensorEntry:
    """One tensor of one rank, as raw memory.

    ``allocate(shape) -> addr`` is called on the engine thread for ops whose output shape is
    only known after negotiation (allgather, alltoall, reducescatter).

    GPU tensors (``device >= 0``) carry device addresses, the raw ``cudaStream_t`` of the
    producer and a ``cudaEvent_t`` recorded on it at submission (``ready_event``), which the
    engine's stream waits on before it touches the tensor.

    A plain slotted class with ``count`` and ``nbytes`` computed once: one is built per
    tensor per step, and the engine reads its sizes several times.
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


class Handle:
    """Completion state of one submitted tensor."""
    __slots__ = ("done", "error", "result", "done_at", "event")

    def __init__(self) -> None:
        self.done = False
        self.error: Optional[str] = None
        self.result: Any = None
        self.done_at: Optional[float] = None  # time.monotonic() at completion (statistics)
        # GPU ops complete when their work is enqueued: a cudaEvent recorded after it, which
        # the consumer's stream must wait on (see aiak_training.common.gpu).
        self.event: int = 0


def unknown_handle(hid: int) -> ValueError:
    """The error for a handle this process never issued, or whose result was already taken."""
    return ValueError(f"Handle {hid} was not created or has been cleared.")


class HandleTable:
    """Handles by id, and the condition their waiters sleep on.

    Completion marks a handle done without taking a lock; waiters are woken by
    :meth:`notify`, which the engine calls once per batch of completions (once per fusion
    buffer, not once per tensor).  ``alive`` tells a waiter whether anything can still
    complete its handle; ``failure`` says why not.
    """

    def __init__(self, alive: Callable[[], bool], failure: Callable[[], str]):
        self._handles: Dict[int, Handle] = {}
        self._ids = _counter(1)
        self._cond = threading.Condition(threading.Lock())
        self._alive, self._failure = alive, failure

    def __len__(self) -> int:
        return len(self._handles)

    def create(self) -> int:
        hid = next(self._ids)
        self._handles[hid] = Handle()
        return hid

    def _get(self, hid: int) -> Handle:
        h = self._handles.get(hid)
        if h is None:
            raise unknown_handle(hid)
        return h

    def complete(self, hid: int, error: Optional[str] = None, result: Any = None,
                 event: int = 0) -> None:
        h = self._handles.get(hid)
        if h is None:
            return
        h.error, h.result, h.event = error, result, event
        h.done_at = time.monotonic()
        h.done = True

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def poll(self, hid: int) -> bool:
        return self._get(hid).done

    def event(self, hid: int) -> int:
        """The completion cudaEvent_t of a done GPU handle (0 for host ops or in flight)."""
        h = self._handles.get(hid)
        return h.event if h is not None and h.done else 0

    def completion_time(self, hid: int) -> Optional[float]:
        h = self._handles.get(hid)
        return None if h is None else h.done_at

    def wait(self, hid: int) -> Handle:
        """Block until the handle completes, then forget it; raise if it failed."""
        h = self._get(hid)
        if not h.done:
            with self._cond:
                while not h.done:
                    self._cond.wait(0.5)
                    if not h.done and not self._alive():
                        raise HorovodInternalError(self._failure())
        self._handles.pop(hid, None)  # atomic; submitters only add other ids
        if h.error is not None:
            raise HorovodInternalError(h.error)
        return h

    def wait_any(self, hids: Sequence[int], timeout: Optional[float] = None) -> List[int]:
        """Block until one of ``hids`` is done; return all of them that are, in order.
        The handles stay registered.  ``[]`` when ``hids`` is empty or on timeout."""
        hs = [(hid, self._get(hid)) for hid in hids]
        if not hs:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        # A completion marks its flag before notify() takes the lock, and the flags are read
        # under the lock here, so none can slip through between the test and the wait.
        with self._cond:
            while True:
                done = [hid for hid, h in hs if h.done]
                if done:
                    return done
                if not self._alive():
                    raise HorovodInternalError(self._failure())
                wait_s = 0.5
                if deadline is not None:
                    wait_s = min(wait_s, deadline - time.monotonic())
                    if wait_s <= 0:
                        return []
                self._cond.wait(wait_s)


@dataclass
class SetState:
    """One process set as the engine runs it on this rank."""
    id: int
    ranks: List[int]
    comm: MPI.Comm
    topology: Topology
    controller: Any          # runtime.controller.Controller
    algorithm: Callable      # the allreduce algorithm (aiak_training.allreduce)
    queue: List[Request] = field(default_factory=list)
    entries: Dict[str, TensorEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read once: the submission path asks for the rank per tensor, and each Get_rank is
        # an MPI call.
        self.size: int = self.comm.Get_size()
        self.rank: int = self.comm.Get_rank()
