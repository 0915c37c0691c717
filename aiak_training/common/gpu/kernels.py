"""The engine's own CUDA kernels (csrc/cuda/batched_copy.cu), when setup.py built them.

They live in ``aiak_training/lib/libaiak_fused_cuda.so`` with the fused optimizer kernels
(``AIAK_FUSED_CUDA_LIB`` names another file).  Without the library (nvcc absent at install
time) the engine copies with one ``cudaMemcpyAsync`` per tensor instead: correct, but the host
then spends a few microseconds per tensor.
"""
import ctypes
import os
from typing import List, Optional

from aiak_training.common.gpu._loader import LazyLibrary


def library_path() -> str:
    """Where setup.py's build_cuda_kernels puts the CUDA library (AIAK_FUSED_CUDA_LIB overrides)."""
    return os.environ.get("AIAK_FUSED_CUDA_LIB") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "lib", "libaiak_fused_cuda.so")


def _declare(lib: ctypes.CDLL, path: str) -> ctypes.CDLL:
    fn = lib.aiak_batched_copy_cuda
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                   ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    lib.aiak_batched_copy_cuda_last_error.restype = ctypes.c_char_p
    lib.aiak_batched_copy_cuda_last_error.argtypes = []
    return lib


_lib = LazyLibrary(lambda: [library_path()], _declare, (),
                   lambda tried: KernelError("; ".join(tried)))


def library() -> Optional[ctypes.CDLL]:
    """The kernel library with ``aiak_batched_copy_cuda``, or None (see :func:`error`)."""
    try:
        return _lib.get()
    except KernelError:
        return None


def error() -> Optional[str]:
    """Why :func:`library` returned None, if it did."""
    try:
        _lib.get()
        return None
    except KernelError as exc:
        return str(exc)


class KernelError(RuntimeError):
    """A kernel launch failed."""


def batched_copy(dsts: List[int], srcs: List[int], sizes: List[int], stream: int) -> None:
    """Copy ``sizes[i]`` bytes from device address ``srcs[i]`` to ``dsts[i]`` for every i, in
    one launch per 64 buffers on ``stream``.  Raises :class:`KernelError` on failure."""
    lib = library()
    if lib is None:
        raise KernelError(f"the CUDA kernel library is not available: {error()}")
    n = len(sizes)
    arr = ctypes.c_void_p * n
    result = lib.aiak_batched_copy_cuda(n, arr(*dsts), arr(*srcs), (ctypes.c_int64 * n)(*sizes),
                                        ctypes.c_void_p(stream))
    if result != 0:
        raise KernelError(lib.aiak_batched_copy_cuda_last_error().decode("utf-8", "replace"))
