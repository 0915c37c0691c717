"""What a job says about itself: rank 0's start-up line, ``aiakrun --help`` and
``aiakrun --check-build``.

* The start-up line names the GPU transport CUDA tensors would really take (the same answer
  as ``--check-build``), every acceleration that is on with what switched it on, and is
  silenced by ``--log-level WARNING`` and higher.
* ``--help`` shows one plain placeholder per value.
* ``--check-build`` ticks CUDA only for a CUDA build of torch, and says how to get kernels
  that were not built.
"""
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Dict, List

import pytest

from aiak_training.common.config import Config
from aiak_training.common.host import build_info
from aiak_training.runner.cli import check_build
from aiak_training.runtime.diagnostics import startup_line
from launch import clean_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AIAKRUN = [sys.executable, "-m", "aiak_training.runner.launch"]
INIT = "import aiak_training.torch as hvd; hvd.init()"


def _env(**extra: str) -> Dict[str, str]:
    return clean_env(**{"OMP_NUM_THREADS": "1", **extra})


def _aiakrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(AIAKRUN + list(args), env=_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


# --------------------------------------------------------------------------- GPU transport
@pytest.mark.parametrize("wanted, nccl, devices, expected", [
    ("nccl", 0, 0, ("none", "no GPU visible; NCCL not found")),
    ("nccl", 21903, 0, ("none", "no GPU visible; NCCL found")),
    ("mpi", 21903, 0, ("none", "no GPU visible; NCCL found")),
    ("nccl", 21903, 2, ("nccl", "NCCL found")),
    ("nccl", 0, 1, ("mpi (staged)", "NCCL not found")),
    ("mpi", 21903, 1, ("mpi (staged)", "asked for")),
])
def test_gpu_path(wanted, nccl, devices, expected):
    assert startup_line.gpu_path(wanted, nccl, devices) == expected


# --------------------------------------------------------------------------- the line
def _engine(num_nodes: int, per_node: int, **config) -> SimpleNamespace:
    topology = SimpleNamespace(rank=0, size=num_nodes * per_node, num_nodes=num_nodes,
                               node_sizes=[per_node] * num_nodes,
                               comm=SimpleNamespace(transport="mpi"))
    return SimpleNamespace(topology=topology, config=Config(**config), sets={})


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(startup_line, "visible_gpus", lambda: 0)
    monkeypatch.setattr(startup_line, "_mpi_library", lambda: "MPICH 5.0.2")
    for var in ("AIAK_OVERLAP_UPDATE", "AIAK_FUSED_OPTIMIZER"):
        monkeypatch.delenv(var, raising=False)


def test_line_with_nothing_on(no_gpu):
    assert startup_line.describe(_engine(1, 2)) == (
        "transport MPI (MPICH 5.0.2); GPU collectives none; allreduce flat "
        "(AIAK_ALLREDUCE_ALGO=auto, but there is a single node; 1 node(s), 2 rank(s)); "
        "accelerations: none")


def test_line_names_what_switched_each_acceleration_on(no_gpu, monkeypatch):
    # Chosen by the topology: several nodes, several ranks on each.
    assert startup_line.describe(_engine(2, 2)).endswith(
        "allreduce hier_pipelined (AIAK_ALLREDUCE_ALGO=auto; 2 node(s), 4 rank(s)); "
        "accelerations: hierarchical allreduce (chosen by the topology: several nodes with "
        "several ranks)")
    # Asked for with Horovod's switch (aiakrun --hierarchical-allreduce), with two others.
    monkeypatch.setenv("AIAK_OVERLAP_UPDATE", "1")
    monkeypatch.setenv("AIAK_FUSED_OPTIMIZER", "1")
    assert startup_line.describe(_engine(2, 2, hierarchical_allreduce=True)).endswith(
        "accelerations: hierarchical allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE=1), "
        "overlap update (AIAK_OVERLAP_UPDATE), fused optimizer (AIAK_FUSED_OPTIMIZER)")
    assert startup_line.describe(_engine(2, 2, allreduce_algo="hier_staged")).split(
        "accelerations: ")[1].startswith("hierarchical allreduce (AIAK_ALLREDUCE_ALGO="
                                         "hier_staged)")
    # Asked for, but one node has no second level: flat, and not listed as on.
    line = startup_line.describe(_engine(1, 4, hierarchical_allreduce=True))
    assert "allreduce flat (HOROVOD_HIERARCHICAL_ALLREDUCE=1, but there is a single node" \
        in line and "hierarchical allreduce (" not in line


def test_line_gpu_transport_follows_nccl_and_setting(monkeypatch):
    monkeypatch.setattr(startup_line, "visible_gpus", lambda: 1)
    monkeypatch.setattr(build_info, "nccl_built", lambda: 21903)
    assert "; GPU collectives nccl; " in startup_line.describe(_engine(1, 2))
    assert "; GPU collectives mpi (staged); " in startup_line.describe(
        _engine(1, 2, gpu_transport="mpi"))
    monkeypatch.setattr(build_info, "nccl_built", lambda: 0)
    assert "; GPU collectives mpi (staged); " in startup_line.describe(_engine(1, 2))


@pytest.mark.parametrize("level, shown", [(None, True), ("info", True), ("DEBUG", True),
                                          ("warning", False), ("ERROR", False),
                                          ("fatal", False)])
def test_log_level_silences_the_lines(monkeypatch, capsys, level, shown):
    monkeypatch.setenv("AIAK_FAILURE_DIR", "/nonexistent")   # as under aiakrun
    if level is None:
        monkeypatch.delenv("HOROVOD_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("HOROVOD_LOG_LEVEL", level)
    startup_line.announce("engine test")
    assert ("[aiak_training INFO] engine test" in capsys.readouterr().err) is shown


def _start_lines(stderr: str) -> List[str]:
    return [ln for ln in stderr.splitlines() if "[aiak_training INFO] transport " in ln]


def test_aiakrun_line_matches_check_build_and_log_level():
    build = _aiakrun("--check-build")
    assert build.returncode == 0, build.stderr
    gpu = re.search(r"GPU collectives: +(.*)", build.stdout).group(1)
    word = ("none" if gpu.startswith("none") else "nccl" if gpu.startswith("NCCL")
            else "mpi (staged)")
    shown = _aiakrun("-np", "2", sys.executable, "-c", INIT)
    assert shown.returncode == 0, shown.stderr
    lines = _start_lines(shown.stderr)
    assert len(lines) == 1 and f"; GPU collectives {word}; " in lines[0], shown.stderr
    assert lines[0].endswith("; accelerations: none"), lines
    quiet = _aiakrun("-np", "2", "--log-level", "WARNING", sys.executable, "-c", INIT)
    assert quiet.returncode == 0, quiet.stderr
    assert "[aiak_training INFO]" not in quiet.stderr, quiet.stderr


def test_aiakrun_line_on_two_virtual_hosts_names_hierarchical():
    proc = _aiakrun("--virtual-hosts", "-H", "a:2,b:2", "-np", "4",
                    "--hierarchical-allreduce", sys.executable, "-c", INIT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = _start_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "allreduce hier_pipelined (HOROVOD_HIERARCHICAL_ALLREDUCE=1; 2 node(s), " \
           "4 rank(s))" in lines[0], lines
    assert lines[0].endswith("accelerations: hierarchical allreduce "
                             "(HOROVOD_HIERARCHICAL_ALLREDUCE=1)"), lines


# --------------------------------------------------------------------------- --help
def test_help_placeholders_are_plain():
    proc = _aiakrun("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    # argparse's default placeholders come from the destination: ELASTIC_ELASTIC_TIMEOUT.
    assert not re.search(r"(?<![A-Z_])ELASTIC_", text), text
    assert not re.search(r"\b([A-Z][A-Z_]{2,}) \1\b", text), text
    assert "--blacklist-cooldown-range MIN MAX" in text
    assert "--elastic-timeout SECONDS" in text and "--min-np N" in text
    assert "--host-discovery-script SCRIPT" in text


# --------------------------------------------------------------------------- --check-build
def _details(text: str) -> Dict[str, str]:
    body = text.split("aiak-training details:\n", 1)[1]
    return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in body.splitlines())}


def test_check_build_ticks_cuda_for_a_cuda_torch_only(monkeypatch):
    monkeypatch.setattr(build_info, "torch_version", lambda: "2.13.0+cpu")
    monkeypatch.setattr(build_info, "torch_cuda_version", lambda: None)
    monkeypatch.setattr(build_info, "rocm_built", lambda: False)
    monkeypatch.setattr(build_info, "cuda_kernel_libraries", lambda: ["/x/libaiak_fused_cuda.so"])
    assert _details(check_build.check_build_text())["CUDA"] == \
        "[ ] torch 2.13.0+cpu without CUDA; aiak-training CUDA kernels built"
    monkeypatch.setattr(build_info, "torch_cuda_version", lambda: "12.8")
    assert _details(check_build.check_build_text())["CUDA"].startswith(
        "[X] torch 2.13.0+cpu with CUDA 12.8")


def test_check_build_says_how_to_get_the_kernels(monkeypatch):
    monkeypatch.setattr(build_info, "cuda_kernel_libraries", lambda: [])
    details = _details(check_build.check_build_text())
    assert details["Fused optimizer (CUDA)"].startswith("[ ] not built (to build them, ")
    assert 'AIAK_CUDA_ARCHS="80;90" pip install -e .' in details["Fused optimizer (CUDA)"]
    assert details["CUDA"].endswith("aiak-training CUDA kernels not built")
