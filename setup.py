"""Build script for aiak-training.

The compiled code takes raw pointers, sizes and streams only: nothing here includes or
links a framework's C++ headers, so one build works across PyTorch/TensorFlow versions.

Sources whose names end in ``_avx2.cpp`` or ``_avx512.cpp`` are compiled with the matching
ISA flags; the rest with the portable baseline.  Code picks an implementation at run time
(``__builtin_cpu_supports``), so a single build runs on any x86-64 machine.
"""
import ctypes.util
import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # pybind11 is a build requirement (pyproject.toml)
    from setuptools import Extension as Pybind11Extension

HERE = os.path.dirname(os.path.abspath(__file__))
BASE_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno"]
ISA_FLAGS = {
    "_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}


def _is_x86() -> bool:
    import platform
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


class BuildExt(build_ext):
    """build_ext that adds per-source ISA flags (see module docstring)."""

    def build_extension(self, ext):
        original_compile = self.compiler._compile

        def _compile(obj, src, ext_name, cc_args, extra_postargs, pp_opts):
            extra = list(extra_postargs)
            for suffix, flags in ISA_FLAGS.items():
                if src.endswith(suffix):
                    if not _is_x86():
                        raise RuntimeError(f"{src}: ISA-specific source on a non-x86 machine")
                    extra += flags
            return original_compile(obj, src, ext_name, cc_args, extra, pp_opts)

        self.compiler._compile = _compile
        try:
            super().build_extension(ext)
        finally:
            self.compiler._compile = original_compile
        build_cuda_kernels(self)


def _sources(pattern: str):
    files = sorted(glob.glob(os.path.join(HERE, pattern)))
    if not _is_x86():
        files = [f for f in files if not any(f.endswith(s) for s in ISA_FLAGS)]
    return [os.path.relpath(f, HERE) for f in files]


def _extension(name: str, pattern: str):
    return Pybind11Extension(
        name,
        _sources(pattern),
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args=BASE_FLAGS,
        extra_link_args=["-pthread"],
        language="c++",
    )


# --- CUDA kernels (owned by fused_optim / CUDA work) -------------------------------------
def build_cuda_kernels(cmd) -> None:
    """Build the CUDA shared libraries with nvcc when it is present.

    They are plain C ABI libraries loaded with ctypes, so they need no framework headers.
    """
    return None
# ------------------------------------------------------------------------------------------


def _install_requires():
    reqs = ["numpy>=1.21", "mpi4py>=4.0", "cloudpickle>=2.0", "psutil>=5.0"]
    # MPICH from PyPI is the embedded default, unless a system MPI is present.
    if os.environ.get("AIAK_USE_SYSTEM_MPI", "") != "1" and not ctypes.util.find_library("mpi"):
        reqs.append("mpich")
    return reqs


ext_modules = [_extension("aiak_training._native", "csrc/native/*.cpp")]
if _sources("csrc/fused_optim/*.cpp"):
    ext_modules.append(_extension("aiak_training.fused_optim._cpu", "csrc/fused_optim/*.cpp"))

setup(
    name="aiak-training",
    version="0.1.0",
    description="Horovod-compatible distributed training for PyTorch and TensorFlow, "
                "with hierarchical allreduce, DGC, overlapped updates and fused optimizers",
    packages=find_packages(include=["aiak_training", "aiak_training.*"]),
    package_data={"aiak_training": ["compat/horovod_shim/**/*.py", "lib/*.so"]},
    python_requires=">=3.9",
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExt},
    install_requires=_install_requires(),
    extras_require={
        "torch": ["torch>=2.1"],
        "test": ["pytest>=7", "scikit-learn>=1.0"],
    },
    entry_points={"console_scripts": ["aiakrun = aiak_training.runner.launch:main"]},
    zip_safe=False,
)
