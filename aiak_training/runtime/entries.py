"""The runtime's shared data: tensor entries, wait results, per-process-set state.

The engine, the CPU executor and the GPU executor all work on these types; keeping them
here, below all three, lets each of those modules import only what it uses.
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from mpi4py import MPI

from aiak_training.common.dtypes import ITEMSIZE, DataType
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
    __slots__ = ("name", "dtype", "shape", "in_addr", "out_addr", "allocate", "keep",
                 "device", "stream", "ready_event", "count", "nbytes")

    def __init__(self, name: str, dtype: DataType, shape: Tuple[int, ...], in_addr: int,
                 out_addr: int = 0, allocate: Optional[Callable[[Tuple[int, ...]], int]] = None,
                 keep: object = None, device: int = -1, stream: int = 0, ready_event: int = 0):
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.in_addr = in_addr
        self.out_addr = out_addr
        self.allocate = allocate
        self.keep = keep  # references that must outlive the operation
        self.device = device
        self.stream = stream
        self.ready_event = ready_event
        count = 1
        for d in shape:
            count *= d
        self.count = count
        self.nbytes = count * ITEMSIZE[dtype]


class WaitResult:
    """What waiting on a handle gives back: the op's result, and for GPU ops the cudaEvent_t
    recorded after its work (see aiak_training.common.gpu), which the consumer's stream must
    wait on (0 for host ops)."""
    __slots__ = ("result", "event")

    def __init__(self, result: Any = None, event: int = 0) -> None:
        self.result = result
        self.event = event


def unknown_handle(hid: int) -> ValueError:
    """The error for a handle this process never issued, or whose result was already taken."""
    return ValueError(f"Handle {hid} was not created or has been cleared.")


@dataclass
class SetState:
    """One process set as the engine runs it on this rank."""
    id: int
    ranks: List[int]
    comm: MPI.Comm
    topology: Topology
    algorithm: Callable      # the allreduce algorithm (aiak_training.allreduce)
    # The lane's tensors, by name: put here at submission, before the C++ thread can hand
    # their responses to the lane.
    entries: Dict[str, TensorEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read once: the submission path asks for the rank per tensor, and each Get_rank is
        # an MPI call.
        self.size: int = self.comm.Get_size()
        self.rank: int = self.comm.Get_rank()
