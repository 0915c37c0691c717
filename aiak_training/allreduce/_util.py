"""Raw-memory MPI buffers for the allreduce algorithms."""

from typing import Any, List

from mpi4py import MPI

from aiak_training.common.dtypes import ITEMSIZE, DataType, mpi_datatype


def mpi_buf(addr: int, count: int, dtype: DataType, blocks: int = 1) -> list:
    """An mpi4py buffer spec for ``blocks`` x ``count`` elements of ``dtype`` at raw address
    ``addr``; ``count`` is what MPI receives as the count (per rank for the *_block and
    gather collectives, where ``blocks`` is the communicator size)."""
    nbytes = blocks * count * ITEMSIZE[dtype]
    return [MPI.buffer.fromaddress(addr, nbytes), count, mpi_datatype(dtype)]


def allgather_counts(comm: Any, send_addr: int, recv_addr: int, counts: List[int],
                     dtype: DataType) -> None:
    """Gather ``counts[r]`` elements from each rank r of ``comm`` into ``recv_addr``, in rank
    order; this rank's come from ``send_addr``.  Equal counts take ``Allgather``: MPICH runs
    ``Allgatherv`` with a slower algorithm (3x for 16 MiB at 2 ranks on one node)."""
    if counts.count(counts[0]) == len(counts):
        comm.Allgather(mpi_buf(send_addr, counts[0], dtype),
                       mpi_buf(recv_addr, counts[0], dtype, blocks=len(counts)))
        return
    displs = [0] * len(counts)
    for r in range(1, len(counts)):
        displs[r] = displs[r - 1] + counts[r - 1]
    comm.Allgatherv(mpi_buf(send_addr, counts[comm.Get_rank()], dtype),
                    [MPI.buffer.fromaddress(recv_addr, sum(counts) * ITEMSIZE[dtype]),
                     (counts, displs), mpi_datatype(dtype)])
