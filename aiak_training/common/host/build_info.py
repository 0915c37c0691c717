"""What this installation can do, probed cheaply and without ever raising.

Used by ``aiakrun --check-build`` and by the frontends' ``hvd.*_built()`` functions.  Probes
avoid importing heavy modules: frameworks are located with ``importlib.util.find_spec``,
torch's build flags are read from ``torch/version.py`` unless torch is already imported, and
the MPI and NCCL library versions come straight from the shared libraries through ctypes
(``MPI_Get_library_version`` may be called before ``MPI_Init``, so importing mpi4py.MPI, which
would initialize MPI, is not needed).
"""
from __future__ import annotations

import ast
import ctypes
import ctypes.util
import functools
import glob
import importlib.machinery
import importlib.util
import os
import platform
import sys
from typing import Dict, List, Optional

# aiak_training/, three levels above this file (common/host/build_info.py).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _has_module(name: str) -> bool:
    """True if ``name`` can be found (a namespace directory does not count)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def torch_available() -> bool:
    """PyTorch is installed (not imported)."""
    return _has_module("torch")


def tensorflow_available() -> bool:
    """TensorFlow is installed (not imported: importing TF takes seconds)."""
    return _has_module("tensorflow")


@functools.lru_cache(maxsize=None)
def _torch_version_info() -> Dict[str, Optional[str]]:
    """torch.version's ``__version__``, ``cuda`` and ``hip``, without importing torch."""
    mod = sys.modules.get("torch.version")
    if mod is not None:
        return {k: getattr(mod, k, None) for k in ("__version__", "cuda", "hip")}
    info: Dict[str, Optional[str]] = {"__version__": None, "cuda": None, "hip": None}
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return info
        path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ImportError, ValueError):
        return info
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and target.id in info and isinstance(value, ast.Constant):
            info[target.id] = value.value if isinstance(value.value, str) else None
    return info


def torch_version() -> Optional[str]:
    """Installed torch version (e.g. ``"2.3.0+cpu"``), or None if torch is not installed."""
    return _torch_version_info()["__version__"]


def torch_cuda_version() -> Optional[str]:
    """CUDA version torch was built with (e.g. ``"12.1"``), or None for CPU builds."""
    return _torch_version_info()["cuda"]


def cuda_kernel_libraries() -> List[str]:
    """aiak-training's own CUDA libraries (setup.py builds e.g. ``lib/libaiak_fused_cuda.so``)."""
    return sorted(glob.glob(os.path.join(_PACKAGE_DIR, "lib", "*.so")))


def cuda_built() -> bool:
    """True if our CUDA kernel library was built or torch has CUDA support."""
    return bool(cuda_kernel_libraries()) or torch_cuda_version() is not None


def rocm_built() -> bool:
    """True if torch is a ROCm (HIP) build."""
    return _torch_version_info()["hip"] is not None


def gloo_built() -> bool:
    """True if torch is installed: the Gloo transport (``aiakrun --gloo``) runs on
    ``torch.distributed``'s Gloo, which torch's Linux and macOS builds include.  Found
    without importing torch."""
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def ddl_built() -> bool:
    """Always False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """Always False: oneCCL is not supported."""
    return False


def mpi_built() -> bool:
    """True if mpi4py is installed and an MPI library can be loaded."""
    return _has_module("mpi4py") and bool(mpi_library_version())


def _load_libmpi() -> Optional[ctypes.CDLL]:
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is not None:
        return None  # caller uses the already-imported module instead
    try:
        # mpi4py >= 4 picks the MPI library the same way at import; reuse its choice.
        from mpi4py import _mpiabi  # type: ignore[attr-defined]
        return _mpiabi._dlopen_libmpi()
    except Exception:  # noqa: BLE001 - private API; any failure means "try the fallback"
        pass
    for name in (ctypes.util.find_library("mpi"), "libmpi.so.12", "libmpi.so.40", "libmpi.so"):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def mpi_library_version() -> str:
    """The MPI library's version string (first line), or "" if no MPI library is found."""
    try:
        mpi_mod = sys.modules.get("mpi4py.MPI")
        if mpi_mod is not None:
            text = mpi_mod.Get_library_version()
        else:
            lib = _load_libmpi()
            if lib is None:
                return ""
            buf = ctypes.create_string_buffer(8192 + 1)  # >= MPI_MAX_LIBRARY_VERSION_STRING
            length = ctypes.c_int(0)
            if lib.MPI_Get_library_version(buf, ctypes.byref(length)) != 0:
                return ""
            text = buf.value.decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - a probe must never break the caller
        return ""
    # Open MPI's string can carry its terminating NUL through mpi4py; drop it.
    text = text.replace("\x00", "")
    lines = [" ".join(ln.split()) for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _nccl_version_via_ctypes(path: str) -> int:
    try:
        lib = ctypes.CDLL(path)
        version = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(version)) == 0:
            return int(version.value)
    except (OSError, AttributeError):
        pass
    return 0


def nccl_candidates() -> List[str]:
    paths: List[str] = []
    try:
        spec = importlib.util.find_spec("nvidia.nccl")  # nvidia-nccl-cu11/cu12 wheels
        if spec is not None and spec.submodule_search_locations:
            for base in spec.submodule_search_locations:
                paths += sorted(glob.glob(os.path.join(base, "lib", "libnccl.so*")))
    except (ImportError, ValueError):
        pass
    found = ctypes.util.find_library("nccl")
    if found:
        paths.append(found)
    paths.append("libnccl.so.2")
    return paths


@functools.lru_cache(maxsize=None)
def nccl_built() -> int:
    """NCCL_VERSION_CODE (e.g. 21903 for 2.19.3) of a loadable NCCL library, else 0."""
    try:
        for path in nccl_candidates():
            version = _nccl_version_via_ctypes(path)
            if version:
                return version
        if _has_module("cupy"):
            from cupy.cuda import nccl  # type: ignore[import-not-found]
            return int(nccl.get_version())
    except Exception:  # noqa: BLE001 - no NCCL, no GPU driver, broken cupy: all mean 0
        pass
    return 0


@functools.lru_cache(maxsize=None)
def cuda_runtime_summary() -> str:
    """The libcudart the GPU path would use and the devices it sees, or ``not found``."""
    try:
        from aiak_training.common.gpu import cudart
        rt = cudart.runtime()
        n = rt.device_count()
        return f"{rt.path} ({n} device{'s' if n != 1 else ''} visible)"
    except Exception:  # noqa: BLE001 - a probe must never break the caller
        return "not found"


def nccl_version_string(code: int) -> str:
    """21903 -> ``2.19.3`` (NCCL >= 2.9 encodes major*10000 + minor*100 + patch)."""
    if code >= 10000:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"


def _extension_loads(name: str) -> bool:
    """Whether the compiled module ``name`` (e.g. ``aiak_training.fused_optim._cpu``) loads.

    The shared object is loaded straight from its file, because importing it normally would
    first run its parent package's ``__init__`` (``aiak_training.fused_optim`` imports torch,
    seconds of work a probe should not cost).  A module imported already is simply reported.
    """
    if name in sys.modules:
        return True
    package, _, leaf = name.rpartition(".")
    try:
        directory = _PACKAGE_DIR
        for part in package.split(".")[1:]:
            directory = os.path.join(directory, part)
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(directory, leaf + suffix)
            if os.path.isfile(path):
                loader = importlib.machinery.ExtensionFileLoader(name, path)
                spec = importlib.util.spec_from_file_location(name, path, loader=loader)
                if spec is None:
                    return False
                importlib.util.module_from_spec(spec)  # runs PyInit_; not put in sys.modules
                return True
    except Exception:  # noqa: BLE001 - unloadable (missing symbols, wrong ABI) = not available
        return False
    return False


def native_extension_available() -> bool:
    """The compiled core (``aiak_training._native``) loads."""
    return _extension_loads("aiak_training._native")


def fused_optimizer_cpu_available() -> bool:
    """The fused-optimizer CPU extension (``aiak_training.fused_optim._cpu``) loads."""
    return _extension_loads("aiak_training.fused_optim._cpu")


@functools.lru_cache(maxsize=None)
def cpu_simd_level() -> str:
    """Best SIMD level this CPU offers to our kernels: ``avx512``, ``avx2`` or ``baseline``."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"baseline ({platform.machine() or 'unknown'})"
    flags = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return "unknown"
    # The same feature sets setup.py compiles the _avx2 / _avx512 sources for.
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "baseline"
