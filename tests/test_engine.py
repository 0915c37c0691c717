"""The engine (csrc/engine/ and runtime/engine.py): its C ABI, the retired AIAK_ENGINE
choice, its failures and idle park, and the absence of the removed Python engine.
Everything else it does is covered by the per-rank suites, over MPI and over Gloo."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from launch import run_ranks

REPO = Path(__file__).resolve().parent.parent

# The barrier keeps a rank that is done from shutting down (which stops its peers' engines)
# before every rank has checked its engine.
RUNS = [sys.executable, "-c",
        "import torch, aiak_training.torch as hvd; hvd.init(); "
        "out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name='x'); hvd.barrier(); "
        "import os; os.write(1, f'sum={out.tolist()};'.encode())"]
REMOVED = ("aiak_training.runtime.controller", "aiak_training.runtime.native_engine",
           "aiak_training.runtime.response_cache")


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_c_abi_enqueue_and_wait(nranks):
    proc = run_ranks([nranks], [sys.executable, "tests/scripts/c_abi.py"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("c abi checks passed") == nranks, proc.stdout[-4000:]


@pytest.mark.parametrize("setting, warned", [("", False), ("native", False), ("python", True),
                                             ("PYTHON", True)])
def test_engine_variable_is_accepted_or_deprecated(setting, warned):
    """AIAK_ENGINE=native (or unset) is the only engine; AIAK_ENGINE=python, which chose the
    removed Python engine, still runs (on the C++ engine) with a deprecation warning."""
    # "" stands for unset: env_with() copies this process's environment, so it is cleared.
    proc = run_ranks([2], RUNS, env={"AIAK_ENGINE": setting}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count("sum=[2.0, 2.0];") == 2, proc.stdout
    assert proc.stdout.count("AIAK_ENGINE=python is deprecated and ignored") == \
        (2 if warned else 0), proc.stdout


def test_unknown_engine_is_a_clear_error():
    proc = run_ranks([1], RUNS, env={"AIAK_ENGINE": "rust"}, timeout=120)
    assert proc.returncode != 0
    assert "AIAK_ENGINE='rust': expected native (the only engine" in proc.stdout, proc.stdout


def test_no_module_imports_the_removed_python_engine():
    """The Python cycle, its negotiation and response cache are gone: no source file of the
    package, tests, benchmarks or examples imports them, and they cannot be imported."""
    pattern = re.compile(r"^\s*(from|import)\s+aiak_training\.runtime(\.(controller|"
                         r"native_engine|response_cache)\b|\s+import\s+.*\b(controller|"
                         r"native_engine|response_cache)\b)", re.M)
    offenders = []
    for folder in ("aiak_training", "tests", "benchmarks", "examples", "tools"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if pattern.search(path.read_text()):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == [], offenders
    for name in REMOVED:
        assert importlib.util.find_spec(name) is None, name
    engine = (REPO / "aiak_training" / "runtime" / "engine.py").read_text()
    for python_cycle in ("def _cycle", "def _pause", "HandleTable", "Controller("):
        assert python_cycle not in engine, python_cycle


ABANDON = [sys.executable, "-c", """
import torch
import aiak_training.torch as hvd
from aiak_training.runtime import current
hvd.init()
engine = current.engine()
h = hvd.allreduce_async(torch.ones(3), name="queued")
engine.abandon("watchdog says stop")
for call in (lambda: hvd.synchronize(h), lambda: hvd.allreduce(torch.ones(2), name="late")):
    try:
        call()
        raise SystemExit("UNEXPECTED: no error")
    except hvd.HorovodInternalError as exc:
        assert "watchdog says stop" in str(exc), exc
try:
    hvd.synchronize(h)
    raise SystemExit("UNEXPECTED: handle reused")
except ValueError as exc:
    assert "was not created or has been cleared" in str(exc), exc
print("abandon checks passed", flush=True)
"""]


def test_failures_reach_python_as_horovod_errors():
    # A failed handle and a refused submission both raise HorovodInternalError with the
    # reason, and a consumed handle raises ValueError, as in Horovod.
    proc = run_ranks([1], ABANDON, env={"HOROVOD_CYCLE_TIME": "500"}, timeout=120)
    assert "abandon checks passed" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_engine_parks_when_idle(transport):
    """AIAK_IDLE_PARK_MS: idle ranks negotiate at most once per park, and a submission or a
    thread waiting on a handle wakes the parked engine at once."""
    env = {"AIAK_IDLE_PARK_MS": "3000"}
    script = [sys.executable, "tests/scripts/idle_park.py"]
    if transport == "gloo":
        proc = run_ranks([1], [sys.executable, "-m", "aiak_training.runner.launch", "--gloo",
                               "-np", "2", *script], env=env, timeout=120)
    else:
        proc = run_ranks([2], script, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert len(re.findall(r"rank \d: idle negotiations \d+, 10 allreduces", proc.stdout)) == 2, \
        proc.stdout[-4000:]


@pytest.mark.parametrize("setting", ["", "python"])
def test_gloo_jobs_run_the_same_engine(setting):
    """Gloo jobs run the C++ engine too (its transport calls torch's Gloo groups), whatever
    AIAK_ENGINE says."""
    proc = run_ranks([1], [sys.executable, "-m", "aiak_training.runner.launch", "--gloo",
                           "-np", "2", *RUNS], env={"AIAK_ENGINE": setting}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count("sum=[2.0, 2.0];") == 2, proc.stdout
