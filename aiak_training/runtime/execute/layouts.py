"""Where each rank's elements go in the collectives whose layout varies by rank.

Pure functions of a negotiated response; both executors use them.
"""
from typing import List, Tuple

from aiak_training.common.dtypes import ReduceOp
from aiak_training.common.messages import Response


def prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _split_rows(rows: int, size: int) -> List[int]:
    """Rows per rank for reducescatter: the first ``rows % size`` ranks get one extra."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _displacements(counts: List[int]) -> List[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def allgather_layout(resp: Response) -> Tuple[List[int], List[int], Tuple[int, ...]]:
    """Element counts and displacements per rank, and the output shape, of an allgather."""
    shapes = resp.shapes[0]
    row = prod(shapes[0][1:])
    counts = [s[0] * row for s in shapes]
    return counts, _displacements(counts), (sum(s[0] for s in shapes),) + tuple(shapes[0][1:])


def alltoall_layout(resp: Response, me: int, size: int):
    """(send counts, send displs, recv counts, recv displs, recv rows, output shape) of this
    rank in an alltoall, in elements."""
    shape = resp.shapes[0][me]
    row = prod(shape[1:])
    recv_rows = [resp.splits[src][me] for src in range(size)]
    send_counts = [r * row for r in resp.splits[me]]
    recv_counts = [r * row for r in recv_rows]
    return (send_counts, _displacements(send_counts), recv_counts, _displacements(recv_counts),
            recv_rows, (sum(recv_rows),) + tuple(shape[1:]))


def reducescatter_layout(resp: Response, me: int, size: int):
    """Element counts of every rank's block, and this rank's output shape."""
    shape = resp.shapes[0][me]
    rows = _split_rows(shape[0], size)
    row = prod(shape[1:])
    return [r * row for r in rows], (rows[me],) + tuple(shape[1:])


def average_postscale(resp: Response, size: int) -> float:
    """The factor applied after the reduction: postscale, with Average's 1/size folded in
    (divided in float64 as Horovod does; native.scale then rounds it to float32 for float32
    and the half types, so results match Horovod's bit for bit)."""
    return resp.postscale / size if resp.reduce_op == ReduceOp.AVERAGE else resp.postscale
