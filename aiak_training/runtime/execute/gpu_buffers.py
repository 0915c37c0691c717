"""The memory the GPU executor moves tensors through: pinned host buffers for the staged
(MPI) path, and the copies that pack tensors into a fusion buffer and out again.

Used by :mod:`aiak_training.runtime.execute.gpu_executor` on the engine thread; ``rt`` is
the CUDA runtime binding (:func:`aiak_training.common.gpu.cudart.runtime`).
"""
from typing import List

from aiak_training.common.gpu import kernels
from aiak_training.runtime.entries import TensorEntry

FUSION_ALIGN = 16  # bytes between tensors in the device fusion buffer


class HostBuffer:
    """A growing pinned host buffer for staging; it is not overwritten while copies out of it
    may still be in flight (``busy``: an event recorded after the last of them)."""

    def __init__(self, rt):
        self.rt, self.addr, self.nbytes, self.busy = rt, 0, 0, 0

    def get(self, nbytes: int) -> int:
        if self.busy:
            self.rt.event_synchronize(self.busy)
            self.rt.event_put(self.busy)
            self.busy = 0
        if nbytes > self.nbytes:
            self.rt.free_host(self.addr)
            self.nbytes = max(nbytes, 2 * self.nbytes)
            self.addr = self.rt.host_alloc(self.nbytes)
        return self.addr

    def release_after(self, stream: int) -> None:
        self.busy = self.rt.record(stream)

    def free(self) -> None:
        self.rt.free_host(self.addr)
        self.addr, self.nbytes = 0, 0


class StagedEntry:
    """A host stand-in for a GPU entry, for the host collectives."""
    __slots__ = ("name", "dtype", "shape", "in_addr", "out_addr", "allocate", "count", "nbytes")

    def __init__(self, e: TensorEntry, in_addr: int, out_addr: int, allocate):
        self.name, self.dtype, self.shape = e.name, e.dtype, e.shape
        self.count, self.nbytes = e.count, e.nbytes
        self.in_addr, self.out_addr, self.allocate = in_addr, out_addr, allocate


def pack(rt, base: int, srcs: List[int], sizes: List[int], stream: int,
         batched: bool = False, align: int = 1) -> List[int]:
    """Copy buffers into ``base`` on ``stream``, each at an offset rounded up to ``align``
    bytes; return where each landed.

    ``batched`` (device to device only): one kernel launch per 64 buffers
    (:func:`kernels.batched_copy`), whose 16-byte path needs 16-byte aligned offsets.
    Otherwise one cudaMemcpyAsync per buffer, which also serves device-to-host staging (the
    DMA engines copy to pinned memory at full speed).
    """
    offsets = packed_offsets(base, sizes, align)
    copy_buffers(rt, offsets, srcs, sizes, stream, batched)
    return offsets


def packed_offsets(base: int, sizes: List[int], align: int = 1) -> List[int]:
    offsets, off = [], base
    for n in sizes:
        offsets.append(off)
        off += (n + align - 1) // align * align
    return offsets


def unpack(rt, dsts: List[int], offsets: List[int], sizes: List[int], stream: int,
           batched: bool = False) -> None:
    """The inverse of :func:`pack`."""
    copy_buffers(rt, dsts, offsets, sizes, stream, batched)


def copy_buffers(rt, dsts, srcs, sizes, stream, batched) -> None:
    if batched:
        kernels.batched_copy(dsts, srcs, sizes, stream)
        return
    for dst, src, n in zip(dsts, srcs, sizes):
        rt.memcpy_async(dst, src, n, stream)
