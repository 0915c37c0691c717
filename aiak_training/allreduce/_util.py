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
    ``Allgatherv`` with a slower algorithm (3x for 16 MiB at 2 ranks on one node).  With equal
    counts ``send_addr`` may be this rank's own block of the output: MPI then gathers in place
    (no local copy; MPICH's in-place gather of 16 MiB at 2 ranks took half the time)."""
    if counts.count(counts[0]) == len(counts):
        count = counts[0]
        send: Any = mpi_buf(send_addr, count, dtype)
        # Gloo's wrapper is safe with the aliasing as it is (torch gathers into a buffer of
        # its own, then copies out); MPI forbids it unless it is said.
        if isinstance(comm, MPI.Comm) and \
                send_addr == recv_addr + comm.Get_rank() * count * ITEMSIZE[dtype]:
            send = MPI.IN_PLACE
        comm.Allgather(send, mpi_buf(recv_addr, count, dtype, blocks=len(counts)))
        return
    displs = [0] * len(counts)
    for r in range(1, len(counts)):
        displs[r] = displs[r - 1] + counts[r - 1]
    comm.Allgatherv(mpi_buf(send_addr, counts[comm.Get_rank()], dtype),
                    [MPI.buffer.fromaddress(recv_addr, sum(counts) * ITEMSIZE[dtype]),
                     (counts, displs), mpi_datatype(dtype)])
