"""aiakrun's last line keeps the cause (issue 40): TensorFlow's multi-line exceptions, and
hosts that do not resolve or cannot be reached, over MPI and Gloo.

Jobs really run through aiakrun; an unreachable host is 127.0.0.2 (a loopback address
that aiakrun does not take for this machine, so it starts ssh there, where no sshd
listens).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import List

import pytest

from aiak_training.runner.cli.hosts import ssh_failure
from aiak_training.runner.report.rank_traceback import TracebackWatch
from launch import clean_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AIAKRUN = [sys.executable, "-m", "aiak_training.runner.launch"]
TF_SCRIPT = os.path.join(REPO, "tests", "scripts", "tf_user_code_error.py")


def _aiakrun(args: List[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(AIAKRUN + args, env=clean_env(OMP_NUM_THREADS="1"), cwd=REPO,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.rstrip().splitlines()[-1]


# ---- multi-line exceptions ---------------------------------------------------------------
TF_TRACEBACK = b"""Traceback (most recent call last):
  File "train.py", line 10, in <module>
    step()
  File "/site-packages/tensorflow/python/util/traceback_utils.py", line 153, in error_handler
    raise e.with_traceback(filtered_tb) from None
TypeError: in user code:

    File "train.py", line 7, in step  *
        hvd.broadcast_variables(opt.variables(), root_rank=0)

    TypeError: 'list' object is not callable

"""


def test_watch_takes_the_cause_below_a_heading() -> None:
    watch = TracebackWatch()
    # Fed in pieces, as a pipe delivers it; everything passes through unchanged.
    out = b"".join(watch.feed(TF_TRACEBACK[i:i + 37]) for i in range(0, len(TF_TRACEBACK), 37))
    assert out + watch.flush() == TF_TRACEBACK
    assert watch.last.line == "TypeError: 'list' object is not callable"


def test_watch_keeps_a_complete_first_line() -> None:
    watch = TracebackWatch()
    watch.feed(b"Traceback (most recent call last):\n  File \"x\", line 1\n"
               b"ValueError: bad shape (3, 4)\n    KeyError: not the cause\n")
    assert watch.last.line == "ValueError: bad shape (3, 4)"
    # A heading whose following lines name no error stays as it was; output after the
    # message ends the search.
    watch = TracebackWatch()
    watch.feed(b"Traceback (most recent call last):\n  File \"x\", line 1\n"
               b"RuntimeError: in user code:\n\n    nothing named here\nnext program line\n"
               b"    OSError: printed later, not part of the message\n")
    assert watch.last.line == "RuntimeError: in user code:"


def test_tensorflow_user_code_error_names_its_cause() -> None:
    pytest.importorskip("tensorflow")
    proc = _aiakrun(["-np", "2", sys.executable, TF_SCRIPT])
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = _last_line(proc)
    assert last.startswith("aiakrun: job failed: rank "), last
    assert "raised TypeError: 'list' object is not callable (exit code 1)" in last, last


# ---- hosts -----------------------------------------------------------------------------------
def test_ssh_failure_lines() -> None:
    assert ssh_failure(b"ssh: connect to host 10.0.0.9 port 22: Connection refused\n") == (
        "10.0.0.9", "Connection refused")
    assert ssh_failure(b"ssh: Could not resolve hostname node7: Name or service not known") == (
        "node7", "Name or service not known")
    assert ssh_failure(b"alice@node3: Permission denied (publickey,password).") == (
        "node3", "Permission denied (publickey,password)")
    assert ssh_failure(b"[1] training step 3") is None


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_host_that_does_not_resolve_is_named(tmp_path, transport) -> None:
    gloo = ["--gloo"] if transport == "gloo" else []
    proc = _aiakrun(gloo + ["-np", "2", "-H", "localhost:1,nosuchhost.invalid:1", "true"])
    assert proc.returncode == 2, proc.stderr
    assert _last_line(proc) == (
        "aiakrun: error: host nosuchhost.invalid (listed by -H) does not resolve (Name or "
        "service not known): check the name in -H"), proc.stderr
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nnosuchhost.invalid slots=1\n")
    proc = _aiakrun(gloo + ["-np", "2", "--hostfile", str(hostfile), "true"])
    assert proc.returncode == 2, proc.stderr
    assert "host nosuchhost.invalid (listed by --hostfile " in _last_line(proc), proc.stderr
    assert "--network-interface" not in proc.stderr


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client on this machine")
@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_host_that_cannot_be_reached_is_named(transport) -> None:
    gloo = ["--gloo"] if transport == "gloo" else []
    proc = _aiakrun(gloo + ["-np", "2", "-H", "127.0.0.2:2", "true"], timeout=120)
    assert proc.returncode == 255, proc.stderr[-3000:]
    last = _last_line(proc)
    assert last.startswith("aiakrun: job failed: "), last
    assert "cannot reach host 127.0.0.2 (listed by -H) over ssh: Connection refused" in last
    assert "--network-interface" not in proc.stderr
