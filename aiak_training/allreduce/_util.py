"""Raw-memory MPI buffers for the allreduce algorithms."""

from mpi4py import MPI

from aiak_training.common.dtypes import ITEMSIZE, DataType, mpi_datatype


def mpi_buf(addr: int, count: int, dtype: DataType, blocks: int = 1) -> list:
    """An mpi4py buffer spec for ``blocks`` x ``count`` elements of ``dtype`` at raw address
    ``addr``; ``count`` is what MPI receives as the count (per rank for the *_block and
    gather collectives, where ``blocks`` is the communicator size)."""
    nbytes = blocks * count * ITEMSIZE[dtype]
    return [MPI.buffer.fromaddress(addr, nbytes), count, mpi_datatype(dtype)]
