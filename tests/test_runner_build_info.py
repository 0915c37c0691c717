"""Build probes behind ``aiakrun --check-build`` and ``hvd.*_built()``."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from aiak_training.common.host import build_info

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_constant_probes():
    import importlib.util
    assert build_info.gloo_built() == (importlib.util.find_spec("torch") is not None)
    assert (build_info.ddl_built(), build_info.ccl_built()) == (False, False)
    assert build_info.nccl_version_string(21903) == "2.19.3"
    assert build_info.nccl_version_string(2708) == "2.7.8"


def test_probes_import_nothing_heavy_and_agree_with_the_real_modules():
    code = textwrap.dedent("""
        import importlib.util, json, sys
        from aiak_training.common.host import build_info as b
        probed = dict(torch=b.torch_available(), tf=b.tensorflow_available(),
                      mpi=b.mpi_built(), mpi_version=b.mpi_library_version(),
                      torch_version=b.torch_version(), cuda=b.torch_cuda_version(),
                      rocm=b.rocm_built(), native=b.native_extension_available(),
                      fused=b.fused_optimizer_cpu_available(), simd=b.cpu_simd_level())
        heavy = sorted(m for m in ("torch", "tensorflow", "mpi4py.MPI", "aiak_training.torch",
                                   "aiak_training.fused_optim") if m in sys.modules)
        import torch
        from mpi4py import MPI
        truth = dict(torch=True, tf=importlib.util.find_spec("tensorflow") is not None,
                     mpi_version=" ".join(MPI.Get_library_version().replace("\\x00", "")
                                          .splitlines()[0].split()),
                     torch_version=torch.__version__, cuda=torch.version.cuda,
                     rocm=torch.version.hip is not None)
        print(json.dumps(dict(probed=probed, heavy=heavy, truth=truth)))
        """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    probed, truth = result["probed"], result["truth"]
    assert result["heavy"] == []
    for key, value in truth.items():
        assert probed[key] == value, key
    assert probed["mpi"] is True
    assert probed["simd"] in ("avx512", "avx2", "baseline") or probed["simd"].startswith(
        "baseline (")
    # The compiled modules, when present in the tree, must load through the file-based probe.
    ext = [f for f in os.listdir(os.path.join(REPO, "aiak_training")) if f.startswith("_native.")]
    assert probed["native"] == bool(ext)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a fake NCCL")
def test_nccl_version_is_read_through_ctypes(tmp_path):
    src = tmp_path / "nccl.c"
    src.write_text("int ncclGetVersion(int *v) { *v = 21903; return 0; }\n")
    lib = tmp_path / "libnccl.so.2"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    assert build_info._nccl_version_via_ctypes(str(lib)) == 21903
    assert build_info._nccl_version_via_ctypes(str(tmp_path / "missing.so")) == 0
