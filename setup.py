"""Build script for aiak-training.

The compiled code takes raw pointers, sizes and streams only: nothing here includes or
links a framework's C++ headers, so one build works across PyTorch/TensorFlow versions.

Sources whose names end in ``_avx2.cpp`` or ``_avx512.cpp`` are compiled with the matching
ISA flags; the rest with the portable baseline.  Code picks an implementation at run time
(``__builtin_cpu_supports``), so a single build runs on any x86-64 machine.

Builds are cached by content (:class:`BuildExt`): each extension's shared library is kept
under ``build/aiak-ext-cache/`` keyed by a hash of its sources, headers, flags, compiler and
Python ABI, so a second ``pip install -e '.[extra]'`` with unchanged sources copies the
libraries instead of compiling them again (pip builds each install in fresh temporary
directories, so setuptools' own timestamp check never sees the previous build).
"""
import ctypes.util
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
    # AIAK_BUILD_JOBS=N compiles an extension's sources on N threads (benchmarks/gpu_check.sh
    # on the 16-core GPU machines); unset, the build stays serial.
    ParallelCompile("AIAK_BUILD_JOBS", default=1).install()
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


# --- build cache ----------------------------------------------------------------------
def cache_dir() -> str:
    """Where built libraries are kept between builds (``AIAK_BUILD_CACHE`` moves it)."""
    return os.environ.get("AIAK_BUILD_CACHE") or os.path.join(HERE, "build", "aiak-ext-cache")


@functools.lru_cache(maxsize=None)
def _tool_version(executable: str) -> str:
    """First line of ``executable --version``: a compiler upgrade must invalidate the cache."""
    try:
        out = subprocess.run([executable, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
        return out.strip().splitlines()[0] if out.strip() else executable
    except (OSError, subprocess.SubprocessError):
        return executable


def _pybind11_version() -> str:
    try:
        import pybind11
        return pybind11.__version__
    except ImportError:
        return "none"


def content_key(files, *settings) -> str:
    """Hash of the files' names and contents and of ``settings`` (flags, tool versions...)."""
    digest = hashlib.sha256()
    for path in sorted(set(files)):
        path = os.path.join(HERE, path)  # relative names are the checkout's
        digest.update(os.path.relpath(path, HERE).encode() + b"\0")
        with open(path, "rb") as fh:
            digest.update(hashlib.sha256(fh.read()).digest())
    for item in settings:
        digest.update(repr(item).encode() + b"\0")
    return digest.hexdigest()[:24]


def _own_dirs(dirs):
    """The checkout's include directories.  The others are pybind11's, whose path is a new
    temporary directory in each isolated pip build (its version is keyed instead), and
    Python's (keyed by its ABI suffix)."""
    return [os.path.relpath(d, HERE) for d in dirs
            if os.path.abspath(d).startswith(HERE + os.sep)]


def _restore(cached: str, target: str) -> bool:
    """Put the cached library at ``target``; False when there is none (then compile)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        _copy_atomically(cached, target)
        # Dated now, not when it was cached: ``build_ext --inplace`` copies the library into
        # the checkout only when it is newer than the one there, so an older cached build
        # (the sources put back to an earlier state) would otherwise never replace it.
        os.utime(target)
        return True
    except FileNotFoundError:  # not cached, or pruned by a concurrent build just now
        return False


def _copy_atomically(src: str, dst: str) -> None:
    """Copy through a name of this process's own, so that concurrent builds (pip and a
    ``build_ext --inplace`` in the same checkout) never see or write a half-copied file."""
    tmp = f"{dst}.{os.getpid()}.tmp"
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def _store(built: str, cached: str, keep: int = 3) -> None:
    """Copy ``built`` into the cache; older entries of the same library beyond ``keep`` go."""
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        _copy_atomically(built, cached)
        prefix = os.path.basename(cached).rsplit("-", 1)[0] + "-"
        same = sorted((p for p in glob.glob(os.path.join(os.path.dirname(cached), prefix + "*"))
                       if not p.endswith(".tmp")), key=os.path.getmtime, reverse=True)
        for old in same[keep:]:
            os.remove(old)
    except OSError as err:  # a cache that cannot be written only costs the next build time
        print(f"aiak-training: not caching {os.path.basename(built)} ({err})")


class BuildExt(build_ext):
    """build_ext that adds per-source ISA flags and reuses cached builds (module docstring)."""

    def extension_key(self, ext) -> str:
        """Content key of one extension: what its library depends on, nothing else."""
        compiler = list(getattr(self.compiler, "compiler_so", None) or ["cc"])
        linker = list(getattr(self.compiler, "linker_so", None) or [])
        return content_key(
            list(ext.sources) + list(ext.depends), ext.name, compiler, linker,
            _tool_version(compiler[0]), ext.extra_compile_args, ext.extra_link_args,
            ext.define_macros, ext.undef_macros, _own_dirs(ext.include_dirs), ext.libraries,
            sorted(ISA_FLAGS.items()), sysconfig.get_config_var("EXT_SUFFIX"),
            _pybind11_version(), sys.version_info[:2])

    def _position(self, ext) -> str:
        """``[2/4]``: which extension of the build this is (pip shows it with ``-v``)."""
        return f"[{self.extensions.index(ext) + 1}/{len(self.extensions)}]"

    def build_extension(self, ext):
        target = self.get_ext_fullpath(ext.name)
        cached = os.path.join(cache_dir(), f"{ext.name}-{self.extension_key(ext)}.so")
        if not self.force and _restore(cached, target):
            print(f"aiak-training: {self._position(ext)} {ext.name}: sources unchanged, "
                  f"reusing {cached}", flush=True)
        else:
            start = time.monotonic()
            print(f"aiak-training: {self._position(ext)} compiling {ext.name} "
                  f"({len(ext.sources)} sources)", flush=True)
            self._compile_extension(ext)
            print(f"aiak-training: {self._position(ext)} {ext.name} built in "
                  f"{time.monotonic() - start:.0f} s", flush=True)
            _store(target, cached)
        build_cuda_kernels(self)

    def _compile_extension(self, ext) -> None:
        original_compile = self.compiler._compile
        done, lock = [0], threading.Lock()  # sources compiled so far (AIAK_BUILD_JOBS threads)

        def _compile(obj, src, ext_name, cc_args, extra_postargs, pp_opts):
            with lock:
                done[0] += 1
                print(f"aiak-training: {self._position(ext)} {done[0]}/{len(ext.sources)} "
                      f"{os.path.relpath(src, HERE)}", flush=True)
            extra = list(extra_postargs)
            for suffix, flags in ISA_FLAGS.items():
                if src.endswith(suffix):
                    if not _is_x86():
                        raise RuntimeError(f"{src}: ISA-specific source on a non-x86 machine")
                    extra += flags
            return original_compile(obj, src, ext_name, cc_args, extra, pp_opts)

        self.compiler._compile = _compile
        try:
            # force: setuptools' timestamp check compares with the target, which _restore may
            # have left from another key; the cache has already said this key needs a build.
            self.force, force = True, self.force
            super().build_extension(ext)
        finally:
            self.force = force
            self.compiler._compile = original_compile


def _sources(pattern: str):
    files = sorted(glob.glob(os.path.join(HERE, pattern)))
    if not _is_x86():
        files = [f for f in files if not any(f.endswith(s) for s in ISA_FLAGS)]
    return [os.path.relpath(f, HERE) for f in files]


def _headers():
    """Every header under csrc/: a change to any of them rebuilds (and re-keys) the libraries."""
    return sorted(os.path.relpath(p, HERE) for ext in ("h", "hpp")
                  for p in glob.glob(os.path.join(HERE, "csrc", "**", f"*.{ext}"), recursive=True))


def _extension(name: str, *patterns: str):
    return Pybind11Extension(
        name,
        [src for pattern in patterns for src in _sources(pattern)],
        depends=_headers(),
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args=BASE_FLAGS,
        extra_link_args=["-pthread", "-ldl"],
        language="c++",
    )


# --- CUDA kernels (owned by fused_optim / CUDA work) -------------------------------------
DEFAULT_CUDA_ARCHS = "80;90"


def gpu_visible() -> bool:
    """Whether this machine has an NVIDIA GPU the driver exposes (no CUDA call needed)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    gpus = "/proc/driver/nvidia/gpus"
    if os.path.isdir(gpus) and os.listdir(gpus):
        return True
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def cuda_archs(environ=None, has_gpu=None):
    """The compute capabilities to build for, or None when the kernels are not wanted.

    ``AIAK_CUDA_ARCHS`` (e.g. ``"80;90"``) asks for them anywhere; otherwise they are built
    for the default list only where a GPU is visible, so a CPU machine with nvcc installed
    spends no install time on kernels it cannot run.  ``AIAK_SKIP_CUDA=1`` wins over both.
    """
    env = os.environ if environ is None else environ
    if env.get("AIAK_SKIP_CUDA", "") == "1":
        return None
    asked = env.get("AIAK_CUDA_ARCHS", "").strip()
    if not asked:
        if not (gpu_visible() if has_gpu is None else has_gpu):
            return None
        asked = DEFAULT_CUDA_ARCHS
    archs = [a.strip() for a in asked.replace(",", ";").split(";") if a.strip()]
    bad = [a for a in archs if not a.isdigit()]
    if bad or not archs:
        raise SystemExit(f"AIAK_CUDA_ARCHS={asked!r}: give compute capabilities as numbers "
                         "separated by ';', e.g. AIAK_CUDA_ARCHS=\"80;90\"")
    return archs


def _find_nvcc():
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc is None:
        for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
            if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
                return os.path.join(home, "bin", "nvcc")
    return nvcc


def build_cuda_kernels(cmd) -> None:
    """Build the CUDA shared libraries with nvcc when they are wanted (:func:`cuda_archs`).

    They are plain C ABI libraries loaded with ctypes, so they need no framework headers.
    Output: ``aiak_training/lib/libaiak_fused_cuda.so`` (in the build tree, or in the source
    tree with ``--inplace`` and editable installs), from ``csrc/cuda/*.cu``, with SASS for each
    asked architecture plus PTX of the first, which the driver can JIT for newer GPUs.  The
    CUDA runtime is linked statically, so the library does not depend on the CUDA version
    torch was built with.  Compiling needs no GPU.  Without nvcc the step is skipped with a
    note; a failed compile is reported but does not fail the CPU build (the fused optimizers
    then use torch ops on CUDA, and tests/test_fused_optim_cuda.py flags it).  Builds are
    cached like the C++ extensions.
    """
    if getattr(cmd, "_aiak_cuda_done", False):  # build_extension runs once per extension
        return
    cmd._aiak_cuda_done = True
    sources = sorted(glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cu")))
    if not sources:
        return
    archs = cuda_archs()
    if archs is None:
        print("aiak-training: not building the CUDA kernels (no GPU visible, AIAK_CUDA_ARCHS "
              "unset, or AIAK_SKIP_CUDA=1); set AIAK_CUDA_ARCHS=\"80;90\" to build them")
        return
    nvcc = _find_nvcc()
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
    gencode = []
    for a in archs:
        gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    gencode += ["-gencode", f"arch=compute_{archs[0]},code=compute_{archs[0]}"]  # PTX: JIT on newer GPUs
    flags = ["-O3", "-std=c++17", "-shared", "-cudart", "static",
             "-Xcompiler", "-fPIC,-fvisibility=hidden", *gencode]
    cached = os.path.join(cache_dir(), "libaiak_fused_cuda-" + content_key(
        sources + headers, flags, _tool_version(nvcc)) + ".so")
    if not getattr(cmd, "force", False) and _restore(cached, target):
        print(f"aiak-training: CUDA kernels: sources unchanged, reusing {cached}")
        return
    cmdline = [nvcc, *flags, "-I", os.path.join(HERE, "csrc", "cuda"),
               "-I", os.path.join(HERE, "csrc"), *sources, "-o", target + ".tmp"]
    print("aiak-training: building CUDA kernels: " + " ".join(cmdline))
    try:
        subprocess.run(cmdline, check=True)
        os.replace(target + ".tmp", target)
        _store(target, cached)
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


# --- the optional horovodrun command ------------------------------------------------------
HOROVODRUN_SWITCH = "AIAK_HOROVODRUN"


def horovod_installed(site_dirs=None, scripts_dir=None) -> bool:
    """Whether a real Horovod is installed in the environment this install goes to: its
    package metadata, or a ``horovodrun`` command that is not ours."""
    paths = sysconfig.get_paths()
    dirs = site_dirs if site_dirs is not None else {paths["purelib"], paths["platlib"]}
    for d in dirs:
        if glob.glob(os.path.join(d, "horovod-*.dist-info")) or \
                glob.glob(os.path.join(d, "horovod-*.egg-info")):
            return True
    script = os.path.join(scripts_dir or paths["scripts"], "horovodrun")
    if os.path.isfile(script):
        with open(script, "rb") as fh:
            return b"aiak_training" not in fh.read(4096)
    return False


def console_scripts(environ=None, **where):
    """``aiakrun``, plus ``horovodrun`` (the same launcher) when ``AIAK_HOROVODRUN=1`` asks for
    it and no real Horovod is installed, whose ``horovodrun`` it would otherwise replace.
    ``where`` goes to :func:`horovod_installed` (tests point it at a directory of their own)."""
    env = os.environ if environ is None else environ
    scripts = ["aiakrun = aiak_training.runner.launch:main"]
    switch = env.get(HOROVODRUN_SWITCH, "")
    if switch not in ("", "0", "1"):
        raise SystemExit(f"{HOROVODRUN_SWITCH}={switch!r}: use 1 to install the horovodrun "
                         "command, 0 or unset not to")
    if switch == "1":
        if horovod_installed(**where):
            print("aiak-training: Horovod is installed here, so the horovodrun command is left "
                  "to it; use aiakrun (the same flags)")
        else:
            scripts.append("horovodrun = aiak_training.runner.launch:main")
    return scripts


# The engine (csrc/engine/) shares _native with the kernels it calls.
ext_modules = [_extension("aiak_training._native", "csrc/native/*.cpp", "csrc/engine/*.cpp")]
if _sources("csrc/fused_optim/*.cpp"):
    ext_modules.append(_extension("aiak_training.fused_optim._cpu", "csrc/fused_optim/*.cpp"))
if _sources("csrc/dgc/*.cpp"): ext_modules.append(_extension("aiak_training.dgc._dgc_cpu", "csrc/dgc/*.cpp"))
# Adasum (aiak_training/allreduce/adasum.py): dot products and scaled adds, one ISA per file.
if _sources("csrc/adasum/*.cpp"):
    ext_modules.append(_extension("aiak_training.allreduce._adasum_cpu", "csrc/adasum/*.cpp"))

def main() -> None:
    """The package's metadata and build, as pip and ``python setup.py`` run it."""
    setup(
        name="aiak-training",
        version="0.1.0",
        description="Horovod-compatible distributed training for PyTorch and TensorFlow, "
                    "with hierarchical allreduce, DGC, overlapped updates and fused optimizers",
        packages=find_packages(include=["aiak_training", "aiak_training.*"]),
        package_data={"aiak_training": ["compat/horovod_shim/**/*.py", "lib/*.so",
                                        "advisor/profiles/*.json",
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
            # PyYAML: tests/test_kubernetes.py reads the MPIJob manifests.
            "test": ["pytest>=7", "scikit-learn>=1.0", "pyyaml>=5"],
            "examples": ["scikit-learn>=1.0"],
            # aiak_training.ray / aiak_training.spark (their workers talk over the Gloo mode).
            # torch is not listed: install the CPU (or CUDA) wheel you want first.
            "ray": ["ray==2.60.0"],
            "spark": ["pyspark==4.3.0"],
            # aiak_training.lightning (Lightning 2's Trainer(strategy=...)); "lightning" ships
            # both import names, lightning.pytorch and pytorch_lightning.  It asks for
            # torch>=2.1, so the torch installed first stays (pip install --dry-run shows it).
            "lightning": ["lightning==2.6.6"],
            # The documentation site (mkdocs.yml; tests/test_docs.py builds it with --strict) and
            # benchmarks/plots.py, which draws the results pages' PNGs from the JSON.
            "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings[python]==1.0.8",
                     "mkdocstrings-python==2.0.11", "griffelib==2.4.1", "matplotlib>=3.7"],
        },
        entry_points={
            "console_scripts": console_scripts(),
            # hvd.Compression.<name> plugins (aiak_training/torch/compression.py).
            "aiak_training.compressors": ["dgc = aiak_training.dgc:DGCCompressor"],
        },
        zip_safe=False,
    )


if __name__ == "__main__":  # pip and setuptools run it so; tests import the helpers
    main()
