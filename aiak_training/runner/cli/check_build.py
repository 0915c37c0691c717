"""``aiakrun --check-build``: Horovod's report, followed by aiak-training's own details."""
from __future__ import annotations

import os
from typing import Callable

from aiak_training.common.host import build_info

HOROVOD_VERSION = "0.28.1"


def aiak_version() -> str:
    """Installed aiak-training version (package metadata, then ``aiak_training.__version__``)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("aiak-training")
        except PackageNotFoundError:
            pass
    except ImportError:
        pass
    import aiak_training
    return str(getattr(aiak_training, "__version__", "unknown"))


def _mark(flag: bool) -> str:
    return "X" if flag else " "


def _safe(probe: Callable[[], object], default: object) -> object:
    # The report must come out even if one probe is broken in some odd environment.
    try:
        return probe()
    except Exception:  # noqa: BLE001
        return default


def _frontend(name: str) -> bool:
    """Our frontend package for a framework exists (a real package, not an empty directory)."""
    package_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.isfile(os.path.join(package_dir, name, "__init__.py"))


def check_build_text() -> str:
    """The full report (Horovod's layout first, so scripts that parse it keep working)."""
    tf = bool(_safe(build_info.tensorflow_available, False)) and _frontend("tensorflow")
    torch = bool(_safe(build_info.torch_available, False)) and _frontend("torch")
    mpi = bool(_safe(build_info.mpi_built, False))
    nccl = int(_safe(build_info.nccl_built, 0))  # type: ignore[arg-type]
    lines = [
        f"Horovod v{HOROVOD_VERSION} (aiak-training v{aiak_version()}):",
        "",
        "Available Frameworks:",
        f"    [{_mark(tf)}] TensorFlow",
        f"    [{_mark(torch)}] PyTorch",
        "    [ ] MXNet",
        "",
        "Available Controllers:",
        f"    [{_mark(mpi)}] MPI",
        f"    [{_mark(build_info.gloo_built())}] Gloo",
        "",
        "Available Tensor Operations:",
        f"    [{_mark(nccl > 0)}] NCCL",
        f"    [{_mark(build_info.ddl_built())}] DDL",
        f"    [{_mark(build_info.ccl_built())}] CCL",
        f"    [{_mark(mpi)}] MPI",
        f"    [{_mark(build_info.gloo_built())}] Gloo",
        "",
        "aiak-training details:",
        f"    MPI library:              {_safe(build_info.mpi_library_version, '') or 'not found'}",
        f"    CUDA:                     {_cuda_line()}",
        f"    NCCL:                     "
        f"{build_info.nccl_version_string(nccl) if nccl else 'not found'}",
        f"    CUDA runtime:             {_safe(build_info.cuda_runtime_summary, 'not found')}",
        f"    GPU collectives:          {_gpu_path_line(nccl)}",
        f"    Native extension:         "
        f"[{_mark(_safe(build_info.native_extension_available, False))}] aiak_training._native",
        f"    Fused optimizer (CPU):    "
        f"[{_mark(_safe(build_info.fused_optimizer_cpu_available, False))}]"
        " aiak_training.fused_optim._cpu",
        f"    Fused optimizer (CUDA):   {_cuda_libs_line()}",
        f"    CPU SIMD level:           {_safe(build_info.cpu_simd_level, 'unknown')}",
    ]
    return "\n".join(lines)


# How to get the CUDA kernels where they were not built (setup.py builds them only where a
# GPU is visible at install time, or where AIAK_CUDA_ARCHS asks for them).
CUDA_KERNELS_HINT = ("to build them, reinstall with nvcc on PATH and AIAK_CUDA_ARCHS set to "
                     "the GPUs' compute capabilities: AIAK_CUDA_ARCHS=\"80;90\" "
                     "pip install -e .")


def _cuda_line() -> str:
    version = _safe(build_info.torch_version, None)
    cuda = _safe(build_info.torch_cuda_version, None)
    if version is None:
        torch_part = "torch not installed"
    elif cuda:
        torch_part = f"torch {version} with CUDA {cuda}"
    elif _safe(build_info.rocm_built, False):
        torch_part = f"torch {version} with ROCm"
    else:
        torch_part = f"torch {version} without CUDA"
    # The tick is torch's CUDA support alone: a CPU build of torch cannot make CUDA tensors,
    # whatever kernels aiak-training has (they are reported on their own line).
    kernels = "built" if _safe(build_info.cuda_kernel_libraries, []) else "not built"
    return f"[{_mark(bool(cuda))}] {torch_part}; aiak-training CUDA kernels {kernels}"


def _gpu_path_line(nccl: int) -> str:
    """Which transport CUDA tensors take (aiak_training.common.gpu), given the settings; the
    start-up line's "GPU collectives" word comes from the same function."""
    from aiak_training.runtime.diagnostics.startup_line import gpu_path, visible_gpus
    try:
        from aiak_training.common.config import gpu_transport_setting
        wanted = gpu_transport_setting()
    except ValueError as exc:
        return f"invalid setting: {exc}"
    name, why = gpu_path(wanted, nccl, int(_safe(visible_gpus, 0)))  # type: ignore[arg-type]
    if name == "none":
        return f"none ({why})"
    if name == "nccl":
        return ("NCCL (MPI staging where ranks share a GPU or NCCL cannot express an op; "
                "AIAK_GPU_TRANSPORT=mpi forces it)")
    return f"MPI, staged through pinned host memory ({why})"


def _cuda_libs_line() -> str:
    libs = _safe(build_info.cuda_kernel_libraries, [])
    if not libs:
        return f"[ ] not built ({CUDA_KERNELS_HINT})"
    return "[X] " + ", ".join(os.path.basename(p) for p in libs)  # type: ignore[union-attr]
