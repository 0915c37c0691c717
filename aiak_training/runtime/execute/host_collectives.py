"""Collectives on host memory: the data movement both executors share.

The CPU executor (runtime/execute/executor.py) runs them on the tensors' own memory; the GPU
executor's MPI fallback runs them on staged host copies.  Each works on raw addresses over one
process set's communicator (MPI, or Gloo through the same mpi4py-shaped calls) and runs on the
engine thread only.
"""
from typing import List

import numpy as np
from mpi4py import MPI

from aiak_training.allreduce._util import allgather_counts
from aiak_training.allreduce.adasum import adasum_allreduce
from aiak_training.allreduce.hier_scatter import hier_scatter, hierarchical_applies
from aiak_training.common import native
from aiak_training.common.config import Config
from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp, mpi_datatype, mpi_op
from aiak_training.common.messages import OpType, Response
from aiak_training.runtime.entries import SetState, TensorEntry
from aiak_training.runtime.execute.completion import Completer
from aiak_training.runtime.execute.layouts import (allgather_layout, alltoall_layout,
                                                   average_postscale, reducescatter_layout)


def _buf(addr: int, count: int, dtype: DataType) -> list:
    return [MPI.buffer.fromaddress(addr, count * ITEMSIZE[dtype]), count, mpi_datatype(dtype)]


class HostCollectives:
    """Allreduce, allgather, broadcast, alltoall and reducescatter of host memory, with the
    timeline activities around each transfer and one reusable scratch/fusion buffer."""

    def __init__(self, config: Config, completer: Completer):
        self.config = config
        self.completer = completer
        self._fusion = np.empty(0, dtype=np.uint8)

    @property
    def fusion_buffer_bytes(self) -> int:
        """Size of the reusable fusion buffer: it only grows, to the largest fused batch."""
        return self._fusion.nbytes

    def fusion_buffer(self, nbytes: int) -> int:
        if self._fusion.nbytes < nbytes:
            # Grow geometrically so a slowly growing workload does not reallocate every step.
            self._fusion = np.empty(max(nbytes, 2 * self._fusion.nbytes), dtype=np.uint8)
        return self._fusion.ctypes.data

    def reduce_host(self, state, names, addr, count, dtype, op, pre, post) -> None:
        """Allreduce ``count`` elements of host memory at ``addr`` in place, with the scale
        factors (``post`` already includes Average's 1/size)."""
        native.scale(addr, count, int(dtype), pre)
        self.completer.activity(names, "MPI_ALLREDUCE")
        self.reduce(state, addr, [count], dtype, op)
        self.completer.activity(names, None)
        native.scale(addr, count, int(dtype), post)

    @staticmethod
    def reduce(state, addr: int, counts: List[int], dtype: DataType, op: ReduceOp) -> None:
        """Run the set's algorithm on tensors of ``counts`` elements laid end to end; Adasum
        needs the tensor boundaries (per-tensor coefficients), the others only the total."""
        if op == ReduceOp.ADASUM:
            adasum_allreduce(state.topology, addr, counts, dtype)
        else:
            state.algorithm(state.topology, addr, sum(counts), dtype, op)


    # ---- allgather / broadcast / alltoall / reducescatter ------------------------------
    # Each runs on an entry's host addresses and returns the handle's result.
    def run_single(self, state: SetState, resp: Response, e: TensorEntry):
        return {OpType.ALLGATHER: self._allgather, OpType.BROADCAST: self._broadcast,
                OpType.ALLTOALL: self._alltoall,
                OpType.REDUCESCATTER: self._reducescatter}[resp.op_type](state, resp, e)

    def _hier(self, state: SetState):
        """The set's two-level reduce-scatter/allgather, or None where they run flat."""
        if hierarchical_applies(self.config, state.topology, state.id == 0):
            return hier_scatter(state.topology)
        return None

    def _allgather(self, state: SetState, resp: Response, e: TensorEntry):
        dtype = DataType(resp.dtype)
        counts, _, out_shape = allgather_layout(resp)
        out = e.allocate(out_shape)
        self.completer.activity(resp, "MPI_ALLGATHER")
        if sum(counts):
            hier = self._hier(state)
            if hier is not None:
                hier.allgather(e.in_addr, out, counts, dtype)
            else:
                allgather_counts(state.comm, e.in_addr, out, counts, dtype)
        self.completer.activity(resp, None)
        return out_shape

    def _broadcast(self, state: SetState, resp: Response, e: TensorEntry):
        dtype = DataType(resp.dtype)
        count = e.count
        if state.rank == resp.root and e.in_addr != e.out_addr and count:
            native.copy_batch([e.out_addr], [e.in_addr], [e.nbytes])
        self.completer.activity(resp, "MPI_BCAST")
        if count:
            state.comm.Bcast(_buf(e.out_addr, count, dtype), root=resp.root)
        self.completer.activity(resp, None)
        return None

    def _alltoall(self, state: SetState, resp: Response, e: TensorEntry):
        dtype = DataType(resp.dtype)
        send_counts, sdispl, recv_counts, rdispl, recv_rows, out_shape = \
            alltoall_layout(resp, state.rank, state.size)
        out = e.allocate(out_shape)
        t = mpi_datatype(dtype)
        item = ITEMSIZE[dtype]
        self.completer.activity(resp, "MPI_ALLTOALL")
        state.comm.Alltoallv(
            [MPI.buffer.fromaddress(e.in_addr, sum(send_counts) * item), (send_counts, sdispl), t],
            [MPI.buffer.fromaddress(out, sum(recv_counts) * item), (recv_counts, rdispl), t])
        self.completer.activity(resp, None)
        return out_shape, recv_rows

    def _reducescatter(self, state: SetState, resp: Response, e: TensorEntry):
        dtype, op = DataType(resp.dtype), ReduceOp(resp.reduce_op)
        counts, out_shape = reducescatter_layout(resp, state.rank, state.size)
        out = e.allocate(out_shape)
        post = average_postscale(resp, state.size)
        self.completer.activity(resp, "MPI_REDUCESCATTER")
        hier = self._hier(state) if e.count else None
        if hier is not None:
            hier.reducescatter(e.in_addr, out, counts, dtype, op, resp.prescale, post)
            self.completer.activity(resp, None)
            return out_shape
        src = e.in_addr
        if resp.prescale != 1.0 and e.count:
            # One pass: the input is the caller's and stays unscaled.
            src = self.fusion_buffer(e.nbytes)
            native.copy_scaled_batch([src], [e.in_addr], [e.count], int(dtype), resp.prescale)
        if e.count:
            state.comm.Reduce_scatter(_buf(src, e.count, dtype),
                                      _buf(out, counts[state.rank], dtype),
                                      recvcounts=counts, op=mpi_op(dtype, op))
        self.completer.activity(resp, None)
        native.scale(out, counts[state.rank], int(dtype), post)
        return out_shape
