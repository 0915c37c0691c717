"""Hierarchical allreduce of GPU buffers on NCCL: the device counterpart of ``hier_pipelined``.

Per chunk (``hier_pipelined.chunk_spans``, ``AIAK_HIER_GPU_CHUNK_BYTES``, default 16 MiB), with
``L`` ranks per node:

1. reduce-scatter inside the node (NCCL, local communicator): local rank ``j`` ends up with
   slice ``j`` of the chunk reduced over the node;
2. allreduce of that slice across nodes (NCCL, cross communicator, which links the ranks
   with the same local rank): one network flow per GPU, as in ``hier_pipelined``;
3. allgather inside the node: every rank gets every finished slice back.

Stages 1 and 3 run on the engine's stream, stage 2 on a second stream, so the network
allreduce of chunk *i* overlaps the node stages of chunks *i+1* and *i-1*; events order them.
Every rank enqueues in the same order, which NCCL needs across communicators.  A chunk's
``n % L`` trailing elements are reduced by one allreduce on the global communicator.  Needs a
homogeneous cluster (the caller checks).
"""
from typing import Optional

from aiak_training.common.env import env_bool, env_bytes
from aiak_training.allreduce.hier_pipelined import chunk_spans
from aiak_training.common.gpu import nccl
from aiak_training.common.gpu.cudart import Runtime

DEFAULT_GPU_CHUNK_BYTES = 16 * 1024 * 1024


class Reduction:
    """An NCCL reduction for one communicator: a built-in op, or a pre-multiplied sum that
    scales every input by ``factor`` first.  Use as a context manager: the custom op is
    destroyed on exit, which NCCL allows as soon as the last call using it has returned."""

    def __init__(self, comm: nccl.Communicator, op: int, factor: Optional[float],
                 nccl_dtype: int):
        self.comm, self._custom = comm, None
        if factor is not None:
            self._custom = comm.pre_mul_sum(factor, nccl_dtype)
            if self._custom is None:
                raise nccl.NcclError(f"NCCL cannot pre-multiply NCCL type {nccl_dtype} by "
                                     f"{factor}")
        self.op = op if self._custom is None else self._custom

    def __enter__(self) -> int:
        return self.op

    def __exit__(self, *exc) -> None:
        if self._custom is not None:
            self.comm.destroy_op(self._custom)


def hier_chunk_bytes() -> int:
    return env_bytes("AIAK_HIER_GPU_CHUNK_BYTES", DEFAULT_GPU_CHUNK_BYTES, minimum=1024)


def hier_overlap() -> bool:
    """``AIAK_HIER_GPU_OVERLAP=0`` runs all stages on one stream: no overlap between
    communicators, for GPUs too busy to keep several NCCL kernels resident at once (NCCL
    warns that concurrent communicators can then deadlock)."""
    return env_bool("AIAK_HIER_GPU_OVERLAP", True)


def nccl_hier_allreduce(rt: Runtime, comms: dict, addr: int, count: int, itemsize: int,
                        nccl_dtype: int, op: int, factor: Optional[float], stream: int,
                        cross_stream: int, local_rank: int, local_size: int,
                        chunk_bytes: int) -> None:
    """Allreduce ``count`` elements at device address ``addr`` in place.

    ``comms`` holds the ``global``, ``local`` and ``cross`` communicators.  ``op`` is the NCCL
    op for every stage, except that ``factor`` (a pre-multiplied sum) applies at the first
    stage only, and the later stages then sum.  With ``op == AVG`` each stage averages over
    its own ranks, which is the global average on a homogeneous cluster.
    """
    local, cross, flat = comms["local"], comms["cross"], comms["global"]
    later_op = nccl.SUM if factor is not None else op
    pending = None  # (chunk base, slice count, event after its cross stage): allgather next
    with Reduction(local, op, factor, nccl_dtype) as first_op:
        for first, n in chunk_spans(count, itemsize, chunk_bytes, align=local_size):
            base = addr + first * itemsize
            m = n // local_size
            crossed = None
            if m:
                mine = base + local_rank * m * itemsize
                local.reduce_scatter(base, mine, m, nccl_dtype, first_op, stream)
                ready = rt.record(stream)
                rt.wait_event(cross_stream, ready)
                rt.event_put(ready)
                cross.allreduce(mine, mine, m, nccl_dtype, later_op, cross_stream)
                crossed = (base, m, rt.record(cross_stream))
            # The previous chunk's allgather goes after this chunk's reduce-scatter, so the
            # cross-node stage of one chunk overlaps the node stages of its neighbours.
            if pending is not None:
                _allgather(rt, local, pending, nccl_dtype, itemsize, stream, local_rank)
            pending = crossed
            tail = n - m * local_size
            if tail:
                _flat_tail(flat, base + m * local_size * itemsize, tail, nccl_dtype, op,
                           factor, stream)
        if pending is not None:
            _allgather(rt, local, pending, nccl_dtype, itemsize, stream, local_rank)


def _allgather(rt: Runtime, local, pending, nccl_dtype, itemsize, stream, local_rank) -> None:
    base, m, crossed = pending
    rt.wait_event(stream, crossed)
    rt.event_put(crossed)
    local.allgather(base + local_rank * m * itemsize, base, m, nccl_dtype, stream)


def _flat_tail(flat, addr, n, nccl_dtype, op, factor, stream) -> None:
    with Reduction(flat, op, factor, nccl_dtype) as tail_op:
        flat.allreduce(addr, addr, n, nccl_dtype, tail_op, stream)
