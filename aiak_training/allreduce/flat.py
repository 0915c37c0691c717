"""flat: the MPI library's own allreduce on the whole communicator."""
from mpi4py import MPI

from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp, mpi_datatype, mpi_op
from aiak_training.common.topology import Topology


def flat_allreduce(comms: Topology, addr: int, count: int, dtype: DataType, op: ReduceOp) -> None:
    if count == 0:
        return
    buf = MPI.buffer.fromaddress(addr, count * ITEMSIZE[dtype])
    comms.comm.Allreduce(MPI.IN_PLACE, [buf, count, mpi_datatype(dtype)], mpi_op(dtype, op))
