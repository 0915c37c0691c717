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
# -ffp-contract=off: GCC contracts a*b+c into an FMA in C++ by default, even through
# _mm256_mul_ps/_mm256_add_ps, and only where the ISA flags allow it, so the scalar and SIMD
# kernels would round differently.  Kernels write their FMAs explicitly.
BASE_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=off"]
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


def _extension(name: str, *patterns: str):
    return Pybind11Extension(
        name,
        [src for pattern in patterns for src in _sources(pattern)],
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args=BASE_FLAGS,
        extra_link_args=["-pthread", "-ldl"],
        language="c++",
    )


# --- CUDA kernels (owned by fused_optim / CUDA work) -------------------------------------
def build_cuda_kernels(cmd) -> None:
    """Build the CUDA shared libraries with nvcc when it is present.

    They are plain C ABI libraries loaded with ctypes, so they need no framework headers.
    Output: ``aiak_training/lib/libaiak_fused_cuda.so`` (in the build tree, or in the source
    tree with ``--inplace``), from ``csrc/cuda/*.cu``, with SASS for sm_80 and sm_90 plus compute_80 PTX
    that the driver can JIT for newer GPUs (override with ``AIAK_CUDA_ARCHS="80;90"``).  The CUDA runtime is linked
    statically, so the library does not depend on the CUDA version torch was built with.
    Compiling needs no GPU.  Without nvcc, or with ``AIAK_SKIP_CUDA=1``, the step is skipped
    with a note; a failed compile is reported but does not fail the CPU build (the fused
    optimizers then use torch ops on CUDA, and tests/test_fused_optim_cuda.py flags it).
    """
    if getattr(cmd, "_aiak_cuda_done", False):  # build_extension runs once per extension
        return
    cmd._aiak_cuda_done = True
    sources = sorted(glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cu")))
    if not sources:
        return
    if os.environ.get("AIAK_SKIP_CUDA", "") == "1":
        print("aiak-training: AIAK_SKIP_CUDA=1, not building CUDA kernels")
        return
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc is None:
        for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
            if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
                nvcc = os.path.join(home, "bin", "nvcc")
                break
    if nvcc is None:
        print("aiak-training: nvcc not found, skipping the CUDA kernels "
              "(fused optimizers will use torch ops on CUDA tensors)")
        return
    # setuptools clears cmd.inplace while extensions are built, so read the option itself.
    opts = cmd.distribution.command_options.get("build_ext", {})
    inplace = (getattr(cmd, "inplace", False) or bool(opts.get("inplace", (None, False))[1])
               or getattr(cmd, "editable_mode", False))
    if inplace:
        out_dir = os.path.join(HERE, "aiak_training", "lib")
    else:
        out_dir = os.path.join(os.path.abspath(cmd.build_lib), "aiak_training", "lib")
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, "libaiak_fused_cuda.so")
    headers = glob.glob(os.path.join(HERE, "csrc", "cuda", "*.h")) + \
        glob.glob(os.path.join(HERE, "csrc", "common", "*.h"))
    newest = max(os.path.getmtime(f) for f in sources + headers)
    if os.path.exists(target) and os.path.getmtime(target) >= newest and not getattr(cmd, "force", False):
        print(f"aiak-training: {os.path.relpath(target, HERE)} is up to date")
        return
    archs = [a.strip() for a in os.environ.get("AIAK_CUDA_ARCHS", "80;90").replace(",", ";").split(";") if a.strip()]
    gencode = []
    for a in archs:
        gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    gencode += ["-gencode", f"arch=compute_{archs[0]},code=compute_{archs[0]}"]  # PTX: JIT on newer GPUs
    cmdline = [nvcc, "-O3", "-std=c++17", "-shared", "-cudart", "static",
               "-Xcompiler", "-fPIC,-fvisibility=hidden", "-I", os.path.join(HERE, "csrc", "cuda"),
               "-I", os.path.join(HERE, "csrc"),
               *gencode, *sources, "-o", target + ".tmp"]
    print("aiak-training: building CUDA kernels: " + " ".join(cmdline))
    try:
        subprocess.run(cmdline, check=True)
        os.replace(target + ".tmp", target)
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"aiak-training: WARNING: building the CUDA kernels failed ({err}); "
              "the fused optimizers will use torch ops on CUDA tensors", file=sys.stderr)
# ------------------------------------------------------------------------------------------


def _install_requires():
    reqs = ["numpy>=1.21", "mpi4py>=4.0", "cloudpickle>=2.0", "psutil>=5.0"]
    # MPICH from PyPI is the embedded default, unless a system MPI is present.
    if os.environ.get("AIAK_USE_SYSTEM_MPI", "") != "1" and not ctypes.util.find_library("mpi"):
        reqs.append("mpich")
    return reqs


# The engine (csrc/engine/) shares _native with the kernels it calls.
ext_modules = [_extension("aiak_training._native", "csrc/native/*.cpp", "csrc/engine/*.cpp")]
if _sources("csrc/fused_optim/*.cpp"):
    ext_modules.append(_extension("aiak_training.fused_optim._cpu", "csrc/fused_optim/*.cpp"))
if _sources("csrc/dgc/*.cpp"): ext_modules.append(_extension("aiak_training.dgc._dgc_cpu", "csrc/dgc/*.cpp"))
# Adasum (aiak_training/allreduce/adasum.py): dot products and scaled adds, one ISA per file.
if _sources("csrc/adasum/*.cpp"):
    ext_modules.append(_extension("aiak_training.allreduce._adasum_cpu", "csrc/adasum/*.cpp"))

setup(
    name="aiak-training",
    version="0.1.0",
    description="Horovod-compatible distributed training for PyTorch and TensorFlow, "
                "with hierarchical allreduce, DGC, overlapped updates and fused optimizers",
    packages=find_packages(include=["aiak_training", "aiak_training.*"]),
    package_data={"aiak_training": ["compat/horovod_shim/**/*.py", "lib/*.so",
                                    "tensorflow/_status_op.cc"]},
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.9",
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExt},
    install_requires=_install_requires(),
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu==2.21.0", "keras"],
        # Keras 2 for TF_USE_LEGACY_KERAS=1 (aiak_training.keras.legacy).  tf-keras requires
        # the "tensorflow" distribution; next to tensorflow-cpu install it with --no-deps.
        "tf_keras": ["tf-keras==2.21.0"],
        "test": ["pytest>=7", "scikit-learn>=1.0"],
        "examples": ["scikit-learn>=1.0"],
        # aiak_training.ray / aiak_training.spark (their workers talk over the Gloo mode).
        # torch is not listed: install the CPU (or CUDA) wheel you want first.
        "ray": ["ray==2.60.0"],
        "spark": ["pyspark==4.3.0"],
        # The documentation site (mkdocs.yml; tests/test_docs.py builds it with --strict) and
        # benchmarks/plots.py, which draws the results pages' PNGs from the JSON.
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings[python]==1.0.8",
                 "mkdocstrings-python==2.0.11", "griffelib==2.4.1", "matplotlib>=3.7"],
    },
    entry_points={
        "console_scripts": ["aiakrun = aiak_training.runner.launch:main"],
        # hvd.Compression.<name> plugins (aiak_training/torch/compression.py).
        "aiak_training.compressors": ["dgc = aiak_training.dgc:DGCCompressor"],
    },
    zip_safe=False,
)
