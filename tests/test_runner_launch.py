"""aiakrun integration tests: these really launch ranks with the installed MPI (a few seconds)."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from aiak_training.common.host import build_info
from launch import clean_env, processes_with

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Prints one line per rank in a single write, so MPI's per-chunk labels cannot split it.
PRINT_RANK = ("import os, sys; sys.stdout.write('rank=%s host=%s\\n' % "
              "(os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK')), "
              "os.environ.get('HOROVOD_HOSTNAME')))")


_env = clean_env  # no switches leaking in from outside


def aiakrun(*argv, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "aiak_training.runner.launch", *argv],
                          env=env or _env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, cwd=REPO)


def _ranks(stdout):
    return sorted((int(r), h) for r, h in re.findall(r"rank=(\d+) host=(\S+)", stdout))


def test_two_ranks_run_with_their_mpi_rank():
    proc = aiakrun("-np", "2", sys.executable, "-c", PRINT_RANK)
    assert proc.returncode == 0, proc.stderr
    assert _ranks(proc.stdout) == [(0, "None"), (1, "None")]


def test_print_output_arrives_as_whole_labelled_lines():
    # print() under PYTHONUNBUFFERED=1 writes text and newline separately; the wrapper joins
    # them so the launcher's rank label starts every line and appears nowhere else.
    proc = aiakrun("-np", "2", sys.executable, "-c", "for i in range(40): print('line', i)")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 80
    assert all(re.fullmatch(r"(\[[^\]]*\]\S*\s?)?line \d+", line) for line in lines), lines


def test_virtual_hosts_give_each_rank_its_slot_identity():
    proc = aiakrun("--virtual-hosts", "-H", "a:2,b:2", "-np", "4", sys.executable, "-c",
                   PRINT_RANK)
    assert proc.returncode == 0, proc.stderr
    assert _ranks(proc.stdout) == [(0, "a"), (1, "a"), (2, "b"), (3, "b")]


def test_virtual_hosts_env_switch_and_partial_last_host():
    proc = aiakrun("-H", "a:2,b:2", "-np", "3", sys.executable, "-c", PRINT_RANK,
                   env=_env(AIAK_VIRTUAL_HOSTS="1"))
    assert proc.returncode == 0, proc.stderr
    assert _ranks(proc.stdout) == [(0, "a"), (1, "a"), (2, "b")]


def test_ranks_can_initialize_mpi_through_the_wrapper():
    # MPICH hands each rank its PMI connection as an inherited descriptor (PMI_FD): the
    # wrapper must pass it on or MPI_Init fails.
    code = ("import os, sys; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "sys.stdout.write('rank=%d host=%s sum=%d\\n' % (c.rank, "
            "os.environ.get('HOROVOD_HOSTNAME'), c.allreduce(c.rank + 1)))")
    proc = aiakrun("--virtual-hosts", "-H", "a:2,b:1", "-np", "3", sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"rank=(\d) host=(\S+) sum=(\d+)", proc.stdout)) == [
        ("0", "a", "6"), ("1", "a", "6"), ("2", "b", "6")]


def test_flags_and_x_reach_the_ranks():
    code = ("import os, sys; sys.stdout.write('env=%s,%s,%s,%s\\n' % tuple(os.environ.get(k) "
            "for k in ('HOROVOD_FUSION_THRESHOLD', 'AIAK_ALLREDUCE_ALGO', 'MY_VAR', "
            "'HOROVOD_START_TIMEOUT')))")
    proc = aiakrun("-np", "2", "--fusion-threshold-mb", "32", "--allreduce-algo", "flat",
                   "-x", "MY_VAR=hello world", "--start-timeout", "7", sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"env=(\S+ \S+)", proc.stdout) == ["33554432,flat,hello world,7"] * 2


def test_killed_rank_stops_the_job_and_is_reported():
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    code = (f"import os, time  # {marker}\n"
            "if os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK')) == '1':\n"
            "    time.sleep(0.5); os.kill(os.getpid(), 9)\n"
            "time.sleep(120)\n")
    start = time.monotonic()
    proc = aiakrun("-np", "2", sys.executable, "-c", code, timeout=60)
    elapsed = time.monotonic() - start
    host = socket.gethostname()
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert elapsed < 20, elapsed
    assert f"aiakrun: rank 1 (host {host}) exited with signal SIGKILL" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == (
        f"aiakrun: job failed: rank 1 (host {host}) exited with signal SIGKILL; "
        "the other ranks were stopped")
    assert processes_with(marker) == []


def test_rank_exit_code_is_reported_and_returned():
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    code = (f"import os, sys, time  # {marker}\n"
            "if os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK')) == '0':\n"
            "    sys.exit(3)\n"
            "time.sleep(120)\n")
    start = time.monotonic()
    proc = aiakrun("--virtual-hosts", "-H", "a:1,b:1", "-np", "2", sys.executable, "-c", code)
    assert time.monotonic() - start < 20
    assert proc.returncode == 3, proc.stderr
    assert "aiakrun: rank 0 (host a) exited with exit code 3" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "aiakrun: job failed: rank 0 (host a) exited with exit code 3; "
        "the other ranks were stopped")
    assert processes_with(marker) == []


def test_missing_program_is_reported():
    proc = aiakrun("-np", "1", "aiak-no-such-program")
    assert proc.returncode == 127
    assert (f"aiakrun: job failed: rank 0 (host {socket.gethostname()}) could not start "
            "'aiak-no-such-program': No such file or directory") in proc.stderr


def test_sigint_is_forwarded_and_nothing_is_left():
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    code = (f"import sys, time  # {marker}\n"
            "sys.stdout.write('ready\\n')\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "aiak_training.runner.launch", "-np", "2",
                             sys.executable, "-c", code], env=_env(), cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready = 0
        deadline = time.monotonic() + 30
        while ready < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            ready += "ready" in line
        assert ready == 2
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT
    assert err.rstrip().splitlines()[-1] == "aiakrun: stopped by SIGINT"
    assert "exited with" not in err  # ranks stopped on request are not reported as failures
    assert processes_with(marker) == []


def test_output_filename_writes_per_rank_files(tmp_path):
    code = ("import os, sys; r = os.environ.get('PMI_RANK', os.environ.get("
            "'OMPI_COMM_WORLD_RANK')); sys.stdout.write('out%s\\n' % r); "
            "sys.stderr.write('err%s\\n' % r)")
    proc = aiakrun("-np", "2", "--output-filename", str(tmp_path / "logs"), sys.executable,
                   "-c", code)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text() == f"out{rank}\n"
        assert (tmp_path / "logs" / f"rank.{rank}" / "stderr").read_text() == f"err{rank}\n"
    assert sorted(re.findall(r"out\d", proc.stdout)) == ["out0", "out1"]  # still on console


@pytest.mark.parametrize("argv,message", [
    (["-np", "2", "-H", "a:2,b", "true"],
     "aiakrun: error: invalid host entry 'b' in 'a:2,b': expected host:slots"),
    (["-np", "3", "-H", "localhost:2", "true"],
     "aiakrun: error: -np 3 needs more slots than the 2 given by the host list localhost:2"),
    (["-np", "3", "--gloo", "-H", "localhost:2", "true"],  # the Gloo mode places ranks alike
     "aiakrun: error: -np 3 needs more slots than the 2 given by the host list localhost:2"),
    (["true"], "aiakrun: error: -np/--num-proc is required"),
    (["-np", "1", "--hostfile", "/nonexistent/aiak-hosts", "true"],
     "aiakrun: error: [Errno 2] No such file or directory: '/nonexistent/aiak-hosts'"),
    (["-np", "1", "--min-np", "2", "true"],
     "aiakrun: error: -np 1 is smaller than --min-np 2"),
    (["-np", "1", "--host-discovery-script", "/nonexistent/discover.sh", "true"],
     "aiakrun: error: host discovery script /nonexistent/discover.sh does not exist"),
])
def test_usage_errors(argv, message):
    proc = aiakrun(*argv)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_check_build_output():
    proc = aiakrun("--check-build")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"Horovod v0\.28\.1 \(aiak-training v\S+\):", lines[0])
    tf = build_info.tensorflow_available() and os.path.isfile(
        os.path.join(REPO, "aiak_training", "tensorflow", "__init__.py"))
    nccl = build_info.nccl_built() > 0
    assert lines[1:17] == [
        "", "Available Frameworks:", f"    [{'X' if tf else ' '}] TensorFlow",
        "    [X] PyTorch", "    [ ] MXNet", "",
        "Available Controllers:", "    [X] MPI", "    [X] Gloo", "",  # torch's Gloo
        "Available Tensor Operations:", f"    [{'X' if nccl else ' '}] NCCL",
        "    [ ] DDL", "    [ ] CCL", "    [X] MPI", "    [X] Gloo"]
    details = dict(line.strip().split(":", 1) for line in lines[19:])
    assert details["MPI library"].strip().startswith(("MPICH", "Open MPI", "Intel"))
    assert set(details) == {"MPI library", "CUDA", "NCCL", "CUDA runtime", "GPU collectives",
                            "Native extension", "Fused optimizer (CPU)",
                            "Fused optimizer (CUDA)", "CPU SIMD level"}
    assert details["CPU SIMD level"].strip() in ("avx512", "avx2", "baseline", "unknown") or \
        details["CPU SIMD level"].strip().startswith("baseline (")


def test_version():
    proc = aiakrun("--version")
    assert proc.returncode == 0
    assert re.fullmatch(r"aiakrun \(aiak-training\) \S+, compatible with Horovod 0\.28\.1\n",
                        proc.stdout)
