"""aiakrun and standard input: a ``python -`` program reaches every rank, or aiakrun refuses.

Unit tests: which commands read their program from stdin, and the refusals (a terminal, an
empty stdin, ranks on other hosts).  Job tests really launch 2 ranks, in MPI mode and with
``--gloo``: a piped program runs on both ranks (its 10 s target is a benchmark, not a test),
only rank 0 gets a plain command's stdin (the other rank reads an empty one instead of
blocking), a terminal is refused with the same message, and a Gloo job whose ranks never
joined says so.
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from typing import List

import pytest

from aiak_training.runner.cli.rank_setup import UsageError
from launch import clean_env
from aiak_training.runner.cli.stdin_program import (STDIN_FILE_ENV, rank_stdin,
                                                    reads_program_from_stdin, stdin_program_env)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AIAKRUN = [sys.executable, "-m", "aiak_training.runner.launch"]
MODES = [pytest.param([], id="mpi"), pytest.param(["--gloo"], id="gloo")]
# Standard library only, so that each job stays short (no torch import).
PROGRAM = ("import os\n"
           "rank = os.environ.get('HOROVOD_RANK', os.environ.get('PMI_RANK'))\n"
           "print(f'program ran on rank {rank}', flush=True)\n")


_env = clean_env


def _aiakrun(args: List[str], stdin, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(AIAKRUN + args, env=_env(), cwd=REPO, stdin=stdin,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------
# Unit tests

@pytest.mark.parametrize("command, expected", [
    (["python", "-"], True),
    (["python3", "-u", "-", "--epochs", "3"], True),
    (["/usr/bin/python3.11", "-X", "dev", "-"], True),
    (["python3", "-Wignore", "-B"], True),       # no program at all: it is read from stdin
    (["python"], True),
    (["python3", "--", "-"], True),
    (["python3", "train.py", "-"], False),        # "-" is the script's argument
    (["python3", "-c", "print(1)"], False),
    (["python3", "-uc", "print(1)"], False),
    (["python3", "-m", "pkg.train"], False),
    (["python3", "-X", "-", "t.py"], False),      # "-" is the value of -X
    (["bash", "-"], False),                       # not a Python interpreter
    ([], False),
])
def test_commands_that_read_their_program_from_stdin(command, expected) -> None:
    assert reads_program_from_stdin(command) is expected


def test_program_is_copied_once_for_every_rank(tmp_path) -> None:
    env = stdin_program_env(["python3", "-"], 2, True, str(tmp_path),
                            io.BytesIO(PROGRAM.encode()))
    assert env == {STDIN_FILE_ENV: str(tmp_path / "stdin-program")}
    assert (tmp_path / "stdin-program").read_text() == PROGRAM
    # Any other command: nothing is read, stdin stays the launcher's.
    untouched = io.BytesIO(b"data")
    assert stdin_program_env(["python3", "t.py"], 2, True, str(tmp_path), untouched) == {}
    assert untouched.read() == b"data"


def test_rank_stdin_choice(tmp_path) -> None:
    program = tmp_path / "p"
    program.write_bytes(b"x = 1\n")
    env = {STDIN_FILE_ENV: str(program)}
    with rank_stdin(env, 3) as f:
        assert f.read() == b"x = 1\n"
    assert STDIN_FILE_ENV not in env  # not passed on to the rank's program
    assert rank_stdin({}, 0) is None and rank_stdin({}, None) is None
    assert rank_stdin({}, 1) == subprocess.DEVNULL


def test_refusals_say_how_to_run_it(tmp_path) -> None:
    command = ["python3", "-"]
    how = "save the program to a file (on every host) and run it: aiakrun -np 2 python3 " \
          "program.py"
    with pytest.raises(UsageError) as info:
        stdin_program_env(command, 2, True, str(tmp_path), io.BytesIO(b""))
    assert str(info.value) == ("`python3 -` reads its program from standard input, and "
                               f"standard input is empty; {how}")
    with pytest.raises(UsageError, match="some ranks run on other hosts") as info:
        stdin_program_env(command, 2, False, str(tmp_path), io.BytesIO(b"print(1)\n"))
    assert str(info.value).endswith(how)
    leader, follower = os.openpty()
    try:
        with open(follower, "rb", closefd=False) as tty:
            with pytest.raises(UsageError, match="standard input is a terminal") as info:
                stdin_program_env(command, 2, True, str(tmp_path), tty)
        assert str(info.value).endswith(how)
    finally:
        os.close(leader)
        os.close(follower)
    assert os.listdir(tmp_path) == []  # nothing was written for a refused job


# ------------------------------------------------------------------------------------------
# Jobs


@pytest.mark.parametrize("mode", MODES)
def test_piped_program_runs_on_every_rank(mode, tmp_path) -> None:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    # A hang fails through _aiakrun's timeout (subprocess.TimeoutExpired). The 10 s target
    # is a benchmark (docs/benchmarks/index.md, `stdin_program_s`), which a loaded CI machine
    # must not turn into a failure, so nothing here times the job.
    with open(script, "rb") as stdin:
        proc = _aiakrun(mode + ["-np", "2", sys.executable, "-"], stdin)
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"^\[(\d)\] program ran on rank (\d)$", proc.stdout, re.M)) == [
        ("0", "0"), ("1", "1")], proc.stdout + proc.stderr
    if mode:
        # The ranks never called hvd.init(): a Gloo job says that nothing ran over Gloo.
        assert proc.stderr.rstrip().splitlines()[-1] == (
            "aiakrun: warning: all 2 ranks exited 0 without joining the job: no rank called "
            "hvd.init(), nothing ran over Gloo"), proc.stderr


@pytest.mark.parametrize("mode", MODES)
def test_only_rank_zero_reads_a_plain_commands_stdin(mode, tmp_path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("three\nlines\nhere\n")
    code = ("import os, sys\n"
            "rank = os.environ.get('HOROVOD_RANK', os.environ.get('PMI_RANK'))\n"
            "print(f'rank {rank} read {len(sys.stdin.read().splitlines())} lines')\n")
    with open(data, "rb") as stdin:
        proc = _aiakrun(mode + ["-np", "2", sys.executable, "-c", code], stdin)
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"rank (\d) read (\d) lines", proc.stdout)) == [
        ("0", "3"), ("1", "0")], proc.stdout + proc.stderr


@pytest.mark.parametrize("mode", MODES)
def test_terminal_stdin_is_refused(mode) -> None:
    leader, follower = os.openpty()
    try:
        proc = _aiakrun(mode + ["-np", "2", "python3", "-"], follower, timeout=30)
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "aiakrun: error: `python3 -` reads its program from standard input, and standard "
        "input is a terminal (an interactive session cannot be shared by several ranks); "
        "save the program to a file (on every host) and run it: aiakrun -np 2 python3 "
        "program.py"], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("mode", MODES)
def test_empty_stdin_is_refused(mode) -> None:
    proc = _aiakrun(mode + ["-np", "2", sys.executable, "-"], subprocess.DEVNULL, timeout=30)
    assert proc.returncode == 2
    assert "reads its program from standard input, and standard input is empty" in proc.stderr
