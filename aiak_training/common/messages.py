"""What the frontends submit and what the lane executes: requests in, responses out.

A Request describes one tensor that this rank submits (the C++ engine negotiates it with the
other ranks; csrc/engine/messages.h); a Response is the negotiated decision the C++ thread
hands to the lane (runtime/engine.py), with everything this rank needs to take part,
including the per-rank shapes of allgather and the splits of alltoall.
"""
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import List, Optional, Tuple

from aiak_training.common.dtypes import ITEMSIZE

_ITEMSIZE = {int(k): v for k, v in ITEMSIZE.items()}


class OpType(IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PROCESS_SET = 7
    REMOVE_PROCESS_SET = 8
    ERROR = 9


# Ops that do not carry tensor data and are never cached.
CONTROL_OPS = frozenset({OpType.BARRIER, OpType.JOIN, OpType.ADD_PROCESS_SET,
                         OpType.REMOVE_PROCESS_SET})


class Request:
    """One tensor submitted by one rank (a plain slotted class: built once per tensor per step,
    so it is kept cheap)."""

    __slots__ = ("rank", "name", "op_type", "dtype", "shape", "reduce_op", "prescale",
                 "postscale", "root", "splits", "payload", "device")

    def __init__(self, rank: int, name: str, op_type: OpType, dtype: int = 0,
                 shape: Tuple[int, ...] = (), reduce_op: int = 1, prescale: float = 1.0,
                 postscale: float = 1.0, root: int = -1,
                 splits: Optional[Tuple[int, ...]] = None,
                 payload: Optional[Tuple[int, ...]] = None, device: int = -1):
        self.rank = rank                # rank within the process set
        self.name = name
        self.op_type = op_type
        self.dtype = dtype
        self.shape = shape
        self.reduce_op = reduce_op
        self.prescale = prescale
        self.postscale = postscale
        self.root = root                # broadcast root, as a rank within the process set
        self.splits = splits            # alltoall send splits (rows per destination)
        self.payload = payload          # ranks, for process-set requests
        self.device = device            # CUDA device of the tensor, -1 for host memory

    def __repr__(self) -> str:
        return f"Request({self.name!r}, {OpType(self.op_type).name}, rank={self.rank})"


@dataclass
class Response:
    op_type: OpType
    names: List[str]
    dtype: int = 0
    # Per tensor, the shape on every rank: shapes[i][r].  Allreduce-like ops have identical
    # shapes; allgather's first dimension and alltoall's splits vary.
    shapes: List[List[Tuple[int, ...]]] = field(default_factory=list)
    reduce_op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    splits: Optional[List[Tuple[int, ...]]] = None   # alltoall: splits[r] sent by rank r
    error: str = ""
    joined_ranks: Tuple[int, ...] = ()               # ranks contributing zeros (hvd.join)
    last_joined: int = -1                            # for JOIN responses
    payload: Optional[Tuple[int, ...]] = None
    gpu: bool = False                                # the tensors are in GPU memory

    # Computed on first use and kept: the executor reads them several times per response.
    @cached_property
    def fusion_key(self) -> tuple:
        """Allreduce responses with equal keys can share one fusion buffer."""
        return (self.op_type, self.gpu, self.dtype, self.reduce_op, self.prescale,
                self.postscale, self.joined_ranks)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of the first tensor (the only one, for a fusable response)."""
        count = 1
        for d in self.shapes[0][0]:
            count *= d
        return count * _ITEMSIZE[self.dtype]
