"""A certain deadlock ends the job, by default, with an error that names it (issue 40).

Jobs launched with aiakrun (MPI and Gloo): the mistake the issue found (a sharded
optimizer's ``consolidate_state_dict()`` called on rank 0 only) ends on every rank within
the bound, naming both pending collectives and the helper, with nothing left behind; and
no false positive: a rank that computes for 3 times the warning time, or joins early with
uneven data, is not taken for a deadlock.  The message builder and the error types are
checked directly.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Dict, List

import pytest

from aiak_training.common.exceptions import (DEADLOCK_PREFIX, DeadlockError,
                                             HorovodInternalError, collective_error)
from launch import JOBS, clean_env, processes_with

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(JOBS, "deadlock.py")
AIAKRUN = [sys.executable, "-m", "aiak_training.runner.launch"]
HOST = socket.gethostname()
WARN_S = 5  # HOROVOD_STALL_CHECK_TIME_SECONDS of these jobs


def _run(mode: str, out: str, extra: List[str] = (), warn_s: float = WARN_S,
         timeout: float = 180) -> subprocess.CompletedProcess:
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    env = clean_env(OMP_NUM_THREADS="1", HOROVOD_STALL_CHECK_TIME_SECONDS=str(warn_s))
    proc = subprocess.run(AIAKRUN + ["-np", "2", *extra, sys.executable, SCRIPT, mode, out,
                                     marker], env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    time.sleep(0.5)
    assert processes_with(marker) == [], "the job left processes behind"
    return proc


def _waits(out: str) -> Dict[int, dict]:
    found = {}
    for rank in (0, 1):
        path = os.path.join(out, f"waited.{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                found[rank] = json.load(f)
    return found


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_collective_on_one_rank_ends_with_a_deadlock_error(tmp_path, transport) -> None:
    proc = _run("helper", str(tmp_path), ["--gloo"] if transport == "gloo" else [])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    assert "UNEXPECTED" not in output
    # Every rank raised the deadlock error, within twice the warning time of its wait.
    waits = _waits(str(tmp_path))
    assert sorted(waits) == [0, 1], output[-4000:]
    for record in waits.values():
        assert record["error"] == "DeadlockError", record
        assert WARN_S <= record["waited_s"] < 2 * WARN_S + 5, record
    # The error names what each rank waited in, and the helper rank 0 called.
    first = ("deadlock: rank 0 waits in allgather.allgather_object.sharded.state_keys (from "
             "consolidate_state_dict), rank 1 in allreduce.after_checkpoint; no rank can go on,"
             " as each waits for a collective that the others did not submit (no rank "
             f"submitted or completed one for {WARN_S} s).")
    assert output.count(f"exceptions.DeadlockError: {first}") == 2, output[-4000:]
    assert ("consolidate_state_dict() is a collective that every rank must call; it submitted "
            "allgather.allgather_object.sharded.state_keys on rank 0 only.") in output
    # aiakrun's last line carries it too, cut to the summary's length.
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("aiakrun: job failed: rank "), last
    assert f"raised DeadlockError: {first[:120]}" in last, last


def test_stall_warning_names_the_helper_and_a_late_rank_is_no_deadlock(tmp_path) -> None:
    proc = _run("helper_late", str(tmp_path), warn_s=2)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert output.count("consolidated") == 2, output[-4000:]
    assert "1: [allgather.allgather_object.sharded.state_keys]" in output, output[-4000:]
    assert ("consolidate_state_dict() is a collective that every rank must call; it submitted "
            "allgather.allgather_object.sharded.state_keys on rank 0 only.") in output
    assert "Deadlock" not in output and "deadlock: " not in output


def test_stall_shutdown_time_keeps_horovods_rule(tmp_path) -> None:
    # An explicit HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: Horovod's rule, not the deadlock check.
    proc = _run("helper", str(tmp_path), ["--stall-check-shutdown-time-seconds", "12"], warn_s=2)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    assert "DeadlockError" not in output
    assert "stalled tensors exceeded HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in output
    waits = _waits(str(tmp_path))
    assert sorted(waits) == [0, 1] and all(w["waited_s"] >= 12 for w in waits.values()), waits


@pytest.mark.parametrize("mode", ["late", "join"])
def test_a_rank_that_computes_is_not_deadlocked(tmp_path, mode) -> None:
    proc = _run(mode, str(tmp_path), warn_s=2)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Deadlock" not in output and "deadlock: " not in output
    if mode == "late":
        assert output.count("late allreduce exact") == 2, output[-4000:]
    else:
        assert "rank 0: joined after 1 steps, last joined 1" in output, output[-4000:]
        assert "rank 1: joined after 4 steps, last joined 1" in output, output[-4000:]


def test_error_types() -> None:
    error = collective_error(DEADLOCK_PREFIX + "rank 0 waits in x")
    assert type(error) is DeadlockError and isinstance(error, HorovodInternalError)
    assert type(collective_error("Horovod has been shut down.")) is HorovodInternalError
