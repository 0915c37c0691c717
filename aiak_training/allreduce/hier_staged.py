"""hier_staged: Horovod's hierarchical allreduce, re-implemented on our MPI transport.

This is the baseline that hier_pipelined is measured against.  It follows
``NCCLHierarchicalAllreduce::Execute`` (horovod/common/ops/nccl_operations.cc in Horovod
0.28.1) step by step, with MPI collectives on the
node communicator in place of the NCCL ones:

1. reduce-scatter of ``count // local_size`` elements per rank inside the node;
2. the ``count % local_size`` tail elements are reduced onto the root, local rank
   ``local_size - 1`` (in a heterogeneous cluster *all* elements go this way, through local
   rank 0, and only the roots cross nodes);
3. one MPI allreduce per rank on the cross communicator, all local ranks in parallel; the
   root's call carries its shard and the tail together (Horovod merged them in PR #411);
4. allgather of the shards inside the node;
5. broadcast of the tail from the root.

The stages run strictly one after another, as in Horovod.  Two deliberate differences, both
in the baseline's favour: Horovod ``malloc``s the host staging buffer on every call and copies
device->host->device around the MPI call; on CPU there is no device, so the reduce-scatter
writes straight into a staging buffer that is kept between calls, and the allgather reads
from it.  Horovod pads *fused* buffers to a multiple of ``local_size * 64`` elements; our
engine does not pad, so a remainder always takes the tail path (Horovod's path for unfused
tensors).
"""
import numpy as np
from mpi4py import MPI

from aiak_training.allreduce._util import mpi_buf
from aiak_training.common import native
from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp, mpi_op
from aiak_training.common.topology import Topology


class StagedHierAllreduce:
    """Callable ``(comms, addr, count, dtype, op)``; reduces in place.  Stateless apart from
    the staging buffer, which only grows."""

    name = "hier_staged"

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._staging = np.empty(0, dtype=np.uint8)

    def _staging_addr(self, nbytes: int) -> int:
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, dtype=np.uint8)
        return self._staging.ctypes.data

    def __call__(self, comms: Topology, addr: int, count: int, dtype: DataType,
                 op: ReduceOp) -> None:
        if count == 0:
            return
        t = comms
        isz = ITEMSIZE[dtype]
        mop = mpi_op(dtype, op)
        if t.is_homogeneous:
            per_rank, tail, root = count // t.local_size, count % t.local_size, t.local_size - 1
        else:
            # Horovod: a heterogeneous cluster reduces everything through local rank 0.
            per_rank, tail, root = 0, count, 0
        is_root = t.local_rank == root
        n_cross = per_rank + (tail if is_root else 0)
        staging = self._staging_addr(max(n_cross, 1) * isz)
        tail_addr = addr + per_rank * t.local_size * isz

        if per_rank:
            # mpi4py reads a counted spec of a *_block collective as the per-rank count.
            t.local_comm.Reduce_scatter_block(mpi_buf(addr, per_rank, dtype, blocks=t.local_size),
                                              mpi_buf(staging, per_rank, dtype), mop)
        if tail:
            recv = mpi_buf(staging + per_rank * isz, tail, dtype) if is_root else None
            t.local_comm.Reduce(mpi_buf(tail_addr, tail, dtype), recv, mop, root=root)
        if n_cross and t.cross_size > 1:
            t.cross_comm.Allreduce(MPI.IN_PLACE, mpi_buf(staging, n_cross, dtype), mop)
        if per_rank:
            t.local_comm.Allgather(mpi_buf(staging, per_rank, dtype),
                                   mpi_buf(addr, per_rank, dtype, blocks=t.local_size))
        if tail:
            if is_root:
                native.copy_batch([tail_addr], [staging + per_rank * isz], [tail * isz])
            t.local_comm.Bcast(mpi_buf(tail_addr, tail, dtype), root=root)

    def close(self) -> None:
        self._staging = np.empty(0, dtype=np.uint8)
