"""Loading of the compiled kernels and helpers shared by the fused optimizers.

Two backends, both fed raw pointers so no torch C++ API is involved:

* CPU: the pybind11 module ``aiak_training.fused_optim._cpu`` (csrc/fused_optim/).
* CUDA: the plain-C library ``aiak_training/lib/libaiak_fused_cuda.so`` (csrc/cuda/), loaded
  with ctypes on first use.

When a backend is missing, the optimizers fall back to the single-tensor reference code in
torch ops (correct, slower) and say so once with a warning.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from aiak_training.common.dtypes import DataType
from aiak_training.common.env import env_choice, env_int
from aiak_training.common.once import warn_once

# The dtype codes the kernels (CPU and CUDA) take: the shared DataType numbering.
DTYPE_CODES: Dict[torch.dtype, int] = {
    torch.float32: int(DataType.FLOAT32),
    torch.float16: int(DataType.FLOAT16),
    torch.bfloat16: int(DataType.BFLOAT16),
    torch.float64: int(DataType.FLOAT64),
}
SUPPORTED_DTYPES = tuple(DTYPE_CODES)
LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")

try:  # pragma: no cover - exercised implicitly by every CPU test
    from aiak_training.fused_optim import _cpu as cpu_ext  # type: ignore[attr-defined]
except ImportError as _err:  # not built
    cpu_ext = None
    _CPU_IMPORT_ERROR: Optional[BaseException] = _err
else:
    _CPU_IMPORT_ERROR = None

# Where the CPU kernels' threads come from: "openmp", the OpenMP runtime torch's own CPU
# kernels run on (found in this process), else "own", a pool of the extension's own.
THREADS_ENV_VAR = "AIAK_FUSED_OPTIM_THREAD_POOL"
THREAD_POOLS = ("openmp", "own")
_OPENMP_NAMES = ("libgomp", "libomp", "libiomp5")


def torch_openmp_library() -> Optional[str]:
    """Path of the OpenMP runtime loaded in this process for torch (the one under torch's
    package when there are several), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:  # not Linux
        return None
    found = sorted(p for p in paths if os.path.basename(p).startswith(_OPENMP_NAMES))
    torch_dir = os.path.dirname(torch.__file__)
    found.sort(key=lambda p: not p.startswith(torch_dir))
    return found[0] if found else None


def choose_thread_pool(which: Optional[str] = None) -> str:
    """Point the CPU kernels at torch's OpenMP threads or at their own pool (``which``,
    default ``AIAK_FUSED_OPTIM_THREAD_POOL``, else "openmp"); returns the one in use.  Torch's
    threads are the default: an optimizer step follows backward, whose OpenMP threads keep
    the other cores busy for a while, so a pool of our own finds them taken (why:
    csrc/fused_optim/module.cpp)."""
    if cpu_ext is None:
        return "unavailable"
    if which is None:
        which = env_choice(THREADS_ENV_VAR, "openmp", THREAD_POOLS)
    elif which not in THREAD_POOLS:
        raise ValueError(f"thread pool {which!r}: expected one of {', '.join(THREAD_POOLS)}")
    path = torch_openmp_library() if which == "openmp" else None
    cpu_ext.use_openmp(path or "")
    return cpu_ext.threads_backend()


choose_thread_pool()


def to_float(x: Any) -> float:
    """Python float of a hyper-parameter that may be a 1-element tensor (as torch allows)."""
    if isinstance(x, torch.Tensor):
        return float(x.item())
    return float(x)


def num_threads() -> int:
    """Threads for the CPU kernels: torch's intra-op setting, which follows OMP_NUM_THREADS.

    Using torch's number rather than all cores keeps several ranks on one machine from
    oversubscribing it (each launcher sets OMP_NUM_THREADS / torch.set_num_threads per rank).
    """
    return env_int("AIAK_FUSED_OPTIM_THREADS", max(1, torch.get_num_threads()), minimum=1)


def state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Optimizer states are fp32 for fp32/bf16/fp16 params and fp64 for fp64 params."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def kernel_friendly(tensors: Sequence[torch.Tensor]) -> bool:
    """True when all tensors share one dense memory layout, so they can be walked as flat
    arrays element by element (contiguous, or the same channels-last strides)."""
    first = tensors[0]
    if first.is_contiguous():
        for t in tensors:
            if not t.is_contiguous():
                return False
        return True
    if first.dim() == 4 and first.is_contiguous(memory_format=torch.channels_last):
        stride = first.stride()
        return all(t.stride() == stride and t.dim() == 4 for t in tensors[1:])
    return False


# ----------------------------------------------------------------------------------- CUDA lib
_cuda_lib: Optional[ctypes.CDLL] = None
_cuda_lib_error: Optional[str] = None
_cuda_lock = threading.Lock()

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_I64P = ctypes.POINTER(ctypes.c_int64)
_IP = ctypes.POINTER(ctypes.c_int)
_D = ctypes.c_double
_I = ctypes.c_int

CUDA_SYMBOLS: Tuple[str, ...] = (
    "aiak_fused_cuda_abi_version",
    "aiak_fused_cuda_last_error",
    "aiak_fused_adam_cuda",
    "aiak_fused_sgd_cuda",
    "aiak_fused_lamb_cuda",
    "aiak_fused_lamb_cuda_workspace_bytes",
    "aiak_fused_sum_squares_cuda",
    "aiak_fused_cuda_plan_check",
)
CUDA_ABI_VERSION = 2  # 2: DataType codes for dtypes


def cuda_library_path() -> str:
    """Where setup.py's build_cuda_kernels puts the CUDA library (AIAK_FUSED_CUDA_LIB overrides).
    The engine's copy kernel lives in the same library."""
    from aiak_training.common.gpu.kernels import library_path
    return library_path()


def _declare(lib: ctypes.CDLL) -> None:
    lib.aiak_fused_cuda_abi_version.restype = _I
    lib.aiak_fused_cuda_abi_version.argtypes = []
    lib.aiak_fused_cuda_last_error.restype = ctypes.c_char_p
    lib.aiak_fused_cuda_last_error.argtypes = []
    lib.aiak_fused_adam_cuda.restype = _I
    lib.aiak_fused_adam_cuda.argtypes = [
        _I, _I64P, _PP, _PP, _PP, _PP, _PP, _PP, _PP, _I,  # n, numels, p, g, m, v, vmax, master, steps, dtype
        _D, _D, _D, _D, _D, _I, _I, _I,                  # lr b1 b2 eps wd decoupled amsgrad maximize
        _P, _P, _P,                                      # grad_scale found_inf stream
    ]
    lib.aiak_fused_sgd_cuda.restype = _I
    lib.aiak_fused_sgd_cuda.argtypes = [
        _I, _I64P, _PP, _PP, _PP, _PP, _IP, _I,          # n numels p g buf master first dtype
        _D, _D, _D, _D, _I, _I,                          # lr momentum dampening wd nesterov maximize
        _P, _P, _P,
    ]
    lib.aiak_fused_lamb_cuda_workspace_bytes.restype = ctypes.c_size_t
    lib.aiak_fused_lamb_cuda_workspace_bytes.argtypes = [_I, _I64P]
    lib.aiak_fused_lamb_cuda.restype = _I
    lib.aiak_fused_lamb_cuda.argtypes = [
        _I, _I64P, _PP, _PP, _PP, _PP, _PP, _PP, _I,      # n numels p g m v master steps dtype
        _D, _D, _D, _D, _D, _I, _I, _I, _I,              # lr b1 b2 eps wd bias_corr grad_avg adam_w nvlamb
        _D, _P,                                          # max_grad_norm, global_grad_norm (device f32)
        _P, _P, _P, _P,                                  # grad_scale found_inf workspace stream
    ]
    lib.aiak_fused_sum_squares_cuda.restype = _I
    lib.aiak_fused_sum_squares_cuda.argtypes = [_I, _I64P, _PP, _I, _P, _P, _P]
    lib.aiak_fused_cuda_plan_check.restype = ctypes.c_int64
    lib.aiak_fused_cuda_plan_check.argtypes = [_I, _I64P]


def cuda_lib() -> Optional[ctypes.CDLL]:
    """The CUDA kernel library, or None (with the reason in :func:`cuda_lib_error`)."""
    global _cuda_lib, _cuda_lib_error
    with _cuda_lock:
        if _cuda_lib is not None or _cuda_lib_error is not None:
            return _cuda_lib
        path = cuda_library_path()
        if not os.path.exists(path):
            _cuda_lib_error = f"{path} not found (built by setup.py when nvcc is present)"
            return None
        try:
            lib = ctypes.CDLL(path)
            _declare(lib)
            version = lib.aiak_fused_cuda_abi_version()
            if version != CUDA_ABI_VERSION:
                raise OSError(f"ABI version {version}, expected {CUDA_ABI_VERSION}")
        except (OSError, AttributeError) as err:
            _cuda_lib_error = f"cannot load {path}: {err}"
            return None
        _cuda_lib = lib
        return lib


def cuda_lib_error() -> Optional[str]:
    """Why :func:`cuda_lib` returned None, if it did."""
    cuda_lib()
    return _cuda_lib_error


def ptr_array(tensors: Sequence[Optional[torch.Tensor]]) -> "ctypes.Array[ctypes.c_void_p]":
    """ctypes array of data pointers (null for None)."""
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


def int64_array(values: Sequence[int]) -> "ctypes.Array[ctypes.c_int64]":
    return (ctypes.c_int64 * len(values))(*values)


def int_array(values: Sequence[int]) -> "ctypes.Array[ctypes.c_int]":
    return (ctypes.c_int * len(values))(*values)


class CudaKernelsUnusable(RuntimeError):
    """The library loaded but cannot run on this GPU/driver (no kernel image for the GPU's
    architecture, driver too old for the CUDA runtime it was built with, ...)."""


# cudaErrorInsufficientDriver, cudaErrorNoDevice, cudaErrorInvalidKernelImage,
# cudaErrorNoKernelImageForDevice, cudaErrorUnsupportedPtxVersion, cudaErrorSystemDriverMismatch,
# cudaErrorCompatNotSupportedOnDevice
_UNUSABLE_CODES = {35, 100, 200, 209, 222, 803, 804}
_unusable_devices: set = set()


def check_cuda(rc: int, what: str) -> None:
    """Raise with the library's message if a CUDA entry point failed.  Failures that mean
    "these kernels cannot run here" raise :class:`CudaKernelsUnusable`: they are detected at
    the first launch, before anything was written, so the caller can fall back."""
    if rc != 0:
        lib = cuda_lib()
        msg = lib.aiak_fused_cuda_last_error().decode() if lib is not None else "unknown"
        cls = CudaKernelsUnusable if rc in _UNUSABLE_CODES else RuntimeError
        raise cls(f"{what} failed (code {rc}): {msg}")


def cuda_kernels_usable(device: torch.device) -> bool:
    """Whether the CUDA kernels can be used for tensors on ``device``."""
    return cuda_lib() is not None and device.index not in _unusable_devices


def mark_cuda_unusable(device: torch.device, err: BaseException) -> None:
    """Stop using the CUDA kernels on ``device`` (after :class:`CudaKernelsUnusable`)."""
    _unusable_devices.add(device.index)
    warn_once(f"cuda-unusable-{device.index}",
              f"fused optimizer CUDA kernels cannot run on {device} ({err}); using the slower "
              "torch-op implementation")


def cuda_stream(device: torch.device) -> int:
    """Raw handle of torch's current stream on ``device`` (0 = legacy default stream)."""
    return int(torch.cuda.current_stream(device).cuda_stream)


def scalar_ptr(t: Optional[torch.Tensor], device: torch.device) -> Tuple[Optional[int], Optional[torch.Tensor]]:
    """Device pointer to a float32 copy of a 1-element tensor (grad_scale / found_inf).

    Returns the pointer and the tensor that owns it (keep it alive until the launch)."""
    if t is None:
        return None, None
    owned = t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
    return owned.data_ptr(), owned


def dispatch(kind: str, device: torch.device, n: int,
             tensors_of: Callable[[int], List[torch.Tensor]], use_kernels: bool,
             found_inf: Optional[torch.Tensor], run_fast: Callable[[List[int]], None],
             run_slow: Callable[[List[int]], None]) -> None:
    """Send each of the n parameter positions to the fused kernels (``run_fast``) or to the
    single-tensor reference code (``run_slow``).

    Positions whose tensors cannot be walked as flat arrays, and all positions when the
    compiled backend is missing or cannot run on this GPU, take the reference path.  A non-zero
    ``found_inf`` skips the step: the CUDA kernels check it on the device; the CPU kernels and
    the reference path check it here on the host.
    """
    if device.type == "cpu":
        kernels = use_kernels and cpu_ext is not None
        why = _CPU_IMPORT_ERROR
    else:
        kernels = use_kernels and cuda_kernels_usable(device)
        why = cuda_lib_error() or "kernels unusable on this GPU"
    if use_kernels and not kernels:
        warn_once(f"{kind}-{device.type}", f"fused {kind} kernels unavailable on {device.type} "
                  f"({why}); using the slower reference implementation")
    fast: List[int] = []
    slow: List[int] = []
    for i in range(n):
        (fast if kernels and kernel_friendly(tensors_of(i)) else slow).append(i)
    if device.type == "cpu" and found_inf is not None and to_float(found_inf) != 0.0:
        return
    if fast:
        try:
            run_fast(fast)
        except CudaKernelsUnusable as err:  # raised at the first launch, before any write
            mark_cuda_unusable(device, err)
            slow = sorted(slow + fast)
    if slow:
        if found_inf is not None and to_float(found_inf) != 0.0:
            return
        run_slow(slow)


def kernel_buckets(params: Sequence[torch.Tensor], master_params: Sequence[Optional[torch.Tensor]],
                   idx: Sequence[int]) -> Dict[Tuple[torch.dtype, bool], List[int]]:
    """The positions ``idx`` grouped by (parameter dtype, has master weights): each group is
    one kernel call."""
    buckets: Dict[Tuple[torch.dtype, bool], List[int]] = {}
    for i in idx:
        buckets.setdefault((params[i].dtype, master_params[i] is not None), []).append(i)
    return buckets
