"""What ranks tell each other during negotiation: requests in, responses out.

A Request describes one tensor that one rank has submitted; a Response is the coordinator's
decision that a tensor is ready on every rank (or an error), and carries everything a rank
needs to take part, including the per-rank shapes of allgather and the splits of alltoall.
Both are small picklable tuples of plain values.
"""
from dataclasses import dataclass, field
from enum import IntEnum
from typing import List, Optional, Tuple


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


@dataclass(frozen=True)
class Request:
    rank: int                      # rank within the process set
    name: str
    op_type: OpType
    dtype: int = 0
    shape: Tuple[int, ...] = ()
    reduce_op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1                 # broadcast root, as a rank within the process set
    splits: Optional[Tuple[int, ...]] = None   # alltoall send splits (rows per destination)
    payload: Optional[Tuple[int, ...]] = None  # ranks, for process-set requests

    def signature(self) -> tuple:
        """Everything that must match for a cached response to be reused by this rank."""
        return (self.op_type, self.dtype, self.shape, self.reduce_op, self.prescale,
                self.postscale, self.root, self.splits)


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
