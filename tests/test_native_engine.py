"""The native engine (csrc/engine/): its C ABI, and the choice between it and the Python
engine.  Everything else it does is covered by the per-rank suites, which run on it by
default and on the Python engine in the ``*_python_engine`` layouts."""
import re
import sys

import pytest

from launch import run_ranks

# The barrier keeps a rank that is done from shutting down (which stops its peers' engines)
# before every rank has read its engine.
KIND = [sys.executable, "-c",
        "import aiak_training.torch as hvd; hvd.init(); "
        "import os; from aiak_training.runtime import current; "
        "kind = current.engine().kind; hvd.barrier(); "
        "os.write(1, f'engine={kind};'.encode())"]


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_c_abi_enqueue_and_wait(nranks):
    proc = run_ranks([nranks], [sys.executable, "tests/scripts/c_abi.py"],
                     env={"AIAK_ENGINE": "native"}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("c abi checks passed") == nranks, proc.stdout[-4000:]


@pytest.mark.parametrize("setting, kind", [("", "native"), ("native", "native"),
                                           ("python", "python"), ("PYTHON", "python")])
def test_engine_selection(setting, kind):
    # "" stands for unset: env_with() copies this process's environment, so it is cleared.
    env = {"AIAK_ENGINE": setting}
    proc = run_ranks([2], KIND, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count(f"engine={kind};") == 2, proc.stdout


def test_unknown_engine_is_a_clear_error():
    proc = run_ranks([1], KIND, env={"AIAK_ENGINE": "rust"}, timeout=120)
    assert proc.returncode != 0
    assert "AIAK_ENGINE='rust': expected one of native, python." in proc.stdout, proc.stdout


ABANDON = [sys.executable, "-c", """
import torch
import aiak_training.torch as hvd
from aiak_training.runtime import current
hvd.init()
engine = current.engine()
assert engine.kind == "native"
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
    # reason, and a consumed handle raises ValueError, as on the Python engine.
    proc = run_ranks([1], ABANDON, env={"HOROVOD_CYCLE_TIME": "500", "AIAK_ENGINE": "native"},
                     timeout=120)
    assert "abandon checks passed" in proc.stdout, proc.stdout[-3000:]


def test_native_engine_parks_when_idle_over_gloo():
    """AIAK_IDLE_PARK_MS on the C++ engine of a Gloo job: idle ranks negotiate at most once
    per park, and a thread waiting on a handle wakes the parked engine at once."""
    env = {"AIAK_ENGINE": "native", "AIAK_IDLE_PARK_MS": "3000"}
    proc = run_ranks([1], [sys.executable, "-m", "aiak_training.runner.launch", "--gloo",
                           "-np", "2", sys.executable, "tests/scripts/idle_park.py"],
                     env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert len(re.findall(r"rank \d: idle negotiations \d+, 10 allreduces", proc.stdout)) == 2, \
        proc.stdout[-4000:]


@pytest.mark.parametrize("setting, kind", [("", "native"), ("python", "python")])
def test_engine_selection_over_gloo(setting, kind):
    """Gloo jobs run the C++ engine too (its transport calls torch's Gloo groups);
    AIAK_ENGINE=python still selects the Python engine."""
    proc = run_ranks([1], [sys.executable, "-m", "aiak_training.runner.launch", "--gloo",
                           "-np", "2", *KIND], env={"AIAK_ENGINE": setting}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count(f"engine={kind};") == 2, proc.stdout
