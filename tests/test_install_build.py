"""setup.py's install-time decisions, without a pip install.

* The build cache: a second build with unchanged sources copies the cached library instead
  of compiling; a changed header or flag, or ``--force``, compiles again; temporary include
  directories (pybind11's, in pip's isolated build) do not change the key.
* The CUDA kernels are wanted only where a GPU is visible or ``AIAK_CUDA_ARCHS`` asks.
* The ``horovodrun`` command exists only with ``AIAK_HOROVODRUN=1``, and never where a real
  Horovod is installed.

setup.py is imported as a module (its ``setup()`` call runs only as ``__main__``).  The cache
test compiles a two-line C extension, so it takes a few seconds.
"""
import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("aiak_setup_under_test",
                                                  os.path.join(REPO, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_C = """
#include <Python.h>
#include "answer.h"
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "tiny", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_tiny(void) {
    PyObject *m = PyModule_Create(&def);
    if (m) PyModule_AddIntConstant(m, "ANSWER", ANSWER);
    return m;
}
"""


class _Counter:
    def __init__(self, setup_py, monkeypatch):
        self.calls = 0
        original = setup_py.BuildExt._compile_extension

        def counting(cmd, ext):
            self.calls += 1
            return original(cmd, ext)

        monkeypatch.setattr(setup_py.BuildExt, "_compile_extension", counting)


def _build(setup_py, tmp_path, run: str, force: bool = False) -> str:
    """Build the tiny extension into a fresh build directory (as each pip install does);
    return the library's path."""
    from setuptools import Distribution, Extension
    ext = Extension("tiny", [str(tmp_path / "tiny.c")], depends=[str(tmp_path / "answer.h")],
                    include_dirs=[str(tmp_path)])
    dist = Distribution({"name": "tiny", "ext_modules": [ext],
                         "cmdclass": {"build_ext": setup_py.BuildExt}})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(tmp_path / run / "lib")
    cmd.build_temp = str(tmp_path / run / "temp")
    cmd.force = force
    cmd.ensure_finalized()
    cmd.run()
    return cmd.get_ext_fullpath("tiny")


def _answer(path: str) -> int:
    loader = importlib.machinery.ExtensionFileLoader("tiny", path)
    spec = importlib.util.spec_from_loader("tiny", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module.ANSWER


def test_unchanged_sources_reuse_the_build(setup_py, tmp_path, monkeypatch):
    monkeypatch.setenv("AIAK_BUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AIAK_SKIP_CUDA", "1")
    (tmp_path / "tiny.c").write_text(TINY_C)
    (tmp_path / "answer.h").write_text("#define ANSWER 41\n")
    count = _Counter(setup_py, monkeypatch)

    first = _build(setup_py, tmp_path, "one")
    assert count.calls == 1 and _answer(first) == 41
    assert len(os.listdir(tmp_path / "cache")) == 1

    restored_after = time.time()
    second = _build(setup_py, tmp_path, "two")      # a fresh build directory: no compile
    assert count.calls == 1
    # Dated when restored, not when cached: `build_ext --inplace` copies a library into the
    # checkout only when it is newer than the one there.
    assert os.path.getmtime(second) >= restored_after > os.path.getmtime(first) - 1
    with open(first, "rb") as a, open(second, "rb") as b:
        assert a.read() == b.read()

    os.utime(tmp_path / "tiny.c")                    # newer, same content: still no compile
    _build(setup_py, tmp_path, "three")
    assert count.calls == 1

    (tmp_path / "answer.h").write_text("#define ANSWER 42\n")   # a header changed
    fourth = _build(setup_py, tmp_path, "four")
    assert count.calls == 2 and _answer(fourth) == 42
    assert len(os.listdir(tmp_path / "cache")) == 2

    _build(setup_py, tmp_path, "five", force=True)  # --force always compiles
    assert count.calls == 3


def test_key_ignores_temporary_include_dirs_only(setup_py, tmp_path):
    from setuptools import Distribution, Extension
    src = tmp_path / "x.c"
    src.write_text("int x;\n")
    cmd = setup_py.BuildExt(Distribution({"name": "x"}))

    class Compiler:
        compiler_so = ["cc", "-O2"]
        linker_so = ["cc", "-shared"]

    cmd.compiler = Compiler()

    def key(*include_dirs, args=("-O3",)):
        return cmd.extension_key(Extension("x", [str(src)], include_dirs=list(include_dirs),
                                           extra_compile_args=list(args)))

    own = os.path.join(REPO, "csrc")
    assert key(own, "/tmp/pip-build-env-aaaa/overlay/pybind11/include") == \
        key(own, "/tmp/pip-build-env-bbbb/overlay/pybind11/include")
    assert key(own) != key(os.path.join(REPO, "csrc", "engine"))
    assert key(own) != key(own, args=("-O2",))
    before = key(own)
    Compiler.compiler_so = ["c++", "-O2"]     # another compiler
    assert key(own) != before


def test_cuda_kernels_only_where_wanted(setup_py):
    archs = setup_py.cuda_archs
    assert archs({}, has_gpu=False) is None
    assert archs({}, has_gpu=True) == ["80", "90"]
    assert archs({"AIAK_CUDA_ARCHS": "86"}, has_gpu=False) == ["86"]
    assert archs({"AIAK_CUDA_ARCHS": "80, 90"}, has_gpu=False) == ["80", "90"]
    assert archs({"AIAK_CUDA_ARCHS": "80;90", "AIAK_SKIP_CUDA": "1"}, has_gpu=True) is None
    with pytest.raises(SystemExit, match="AIAK_CUDA_ARCHS='sm_80'"):
        archs({"AIAK_CUDA_ARCHS": "sm_80"}, has_gpu=False)


def test_horovodrun_only_on_request_and_never_over_horovod(setup_py, tmp_path):
    site, bin_dir = tmp_path / "site", tmp_path / "bin"
    site.mkdir()
    bin_dir.mkdir()
    where = {"site_dirs": [str(site)], "scripts_dir": str(bin_dir)}
    ours = "horovodrun = aiak_training.runner.launch:main"
    launcher = "aiakrun = aiak_training.runner.launch:main"
    assert setup_py.console_scripts({}, **where) == [launcher]
    assert setup_py.console_scripts({"AIAK_HOROVODRUN": "0"}, **where) == [launcher]
    assert setup_py.console_scripts({"AIAK_HOROVODRUN": "1"}, **where) == [launcher, ours]
    with pytest.raises(SystemExit, match="AIAK_HOROVODRUN='yes'"):
        setup_py.console_scripts({"AIAK_HOROVODRUN": "yes"}, **where)
    # Our own horovodrun, from an earlier install, may be replaced.
    (bin_dir / "horovodrun").write_text("from aiak_training.runner.launch import main\n")
    assert setup_py.console_scripts({"AIAK_HOROVODRUN": "1"}, **where) == [launcher, ours]
    # Someone else's horovodrun (a conda Horovod, say) stays.
    (bin_dir / "horovodrun").write_text("from horovod.runner.launch import run_commandline\n")
    assert setup_py.console_scripts({"AIAK_HOROVODRUN": "1"}, **where) == [launcher]
    (bin_dir / "horovodrun").unlink()
    (site / "horovod-0.28.1.dist-info").mkdir()     # Horovod's package metadata
    assert setup_py.console_scripts({"AIAK_HOROVODRUN": "1"}, **where) == [launcher]


@pytest.mark.parametrize("switch, expected", [("1", True), ("", False)])
def test_horovodrun_reaches_the_package_metadata(tmp_path, switch, expected):
    """The switch as pip sees it: setup.py's own metadata step (no compile)."""
    env = dict(os.environ, AIAK_HOROVODRUN=switch)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "aiak_training.egg-info" / "entry_points.txt") as f:
        entry_points = f.read()
    assert "aiakrun = aiak_training.runner.launch:main" in entry_points
    assert ("horovodrun = aiak_training.runner.launch:main" in entry_points) is expected


def test_build_prints_which_extension_and_source_it_is_at(setup_py, tmp_path, monkeypatch,
                                                          capsys):
    # What `pip install -v` shows while the C++ compiles: extension k of n, source i of m.
    from setuptools import Distribution, Extension
    monkeypatch.setenv("AIAK_BUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AIAK_SKIP_CUDA", "1")
    (tmp_path / "answer.h").write_text("#define ANSWER 7\n")
    for name in ("first", "second"):
        (tmp_path / f"{name}.c").write_text(TINY_C.replace("tiny", name))

    def build(run: str) -> str:
        exts = [Extension(n, [str(tmp_path / f"{n}.c")], include_dirs=[str(tmp_path)])
                for n in ("first", "second")]
        dist = Distribution({"name": "two", "ext_modules": exts,
                             "cmdclass": {"build_ext": setup_py.BuildExt}})
        cmd = dist.get_command_obj("build_ext")
        cmd.build_lib, cmd.build_temp = str(tmp_path / run / "lib"), str(tmp_path / run / "t")
        cmd.ensure_finalized()
        cmd.run()
        return capsys.readouterr().out

    out = build("cold")
    for position, name in (("[1/2]", "first"), ("[2/2]", "second")):
        assert f"aiak-training: {position} compiling {name} (1 sources)" in out, out
        assert f"aiak-training: {position} 1/1 " in out and f"{name}.c" in out, out
        assert re.search(rf"aiak-training: {re.escape(position)} {name} built in \d+ s", out)
    out = build("warm")
    assert "aiak-training: [2/2] second: sources unchanged, reusing" in out, out
    assert "compiling" not in out
