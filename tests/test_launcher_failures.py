"""aiakrun under real mistakes: nothing hangs, nothing is left behind, the right rank is named.

Unit tests (no job): the banner filter, the Ctrl-C traceback filter, the notes that name a
culprit, "did you mean", finding MPI beside the interpreter, the liveness value.  Job tests
really launch ranks with aiakrun (a few seconds each): a rank stuck after a stall shutdown,
uneven steps, ``kill -9`` of aiakrun (here, and on the emulated 2-node cluster when root and
network namespaces are available), Ctrl-C, a script that imports horovod, the start-up line.
Time bounds are the issue's (15 s, 10 s), measured from when every rank has started, so a
loaded machine's slow ``import torch`` does not count.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, List

import pytest

from aiak_training.common.job.records import RankFailure
from aiak_training.runner.cli.flag_errors import suggest
from aiak_training.runner.guard import proc_tree
from aiak_training.runner.guard.interrupt_filter import InterruptTracebackFilter
from aiak_training.runner.guard.liveness import LivenessServer, parse_value
from aiak_training.runner.modes.mpi_flavour import MpiNotFoundError, find_launcher
from aiak_training.runner.report import blame
from aiak_training.runner.report.launcher_output import BannerFilter
from launch import JOBS, clean_env, netns_pids, processes_with, require_emulation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(JOBS, "launcher_faults.py")
AIAKRUN = [sys.executable, "-m", "aiak_training.runner.launch"]
HOST = socket.gethostname()


def _env(**extra: str) -> Dict[str, str]:
    return clean_env(**{"OMP_NUM_THREADS": "1", **extra})


def _wait_ready(out_dir: str, ranks: int, proc: subprocess.Popen, limit: float = 120) -> float:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if all(os.path.exists(os.path.join(out_dir, f"ready.{r}")) for r in range(ranks)):
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not start (aiakrun status {proc.poll()})")


def _start(args: List[str], **popen) -> subprocess.Popen:
    return subprocess.Popen(AIAKRUN + args, env=popen.pop("env", _env()), cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ------------------------------------------------------------------------------------------
# Unit tests

MPICH_BANNER = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 7481 RUNNING AT localhost
=   EXIT CODE: 15
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Terminated (signal 15)
This typically refers to a problem with your application.
Please see the FAQ page for debugging suggestions
"""
OPEN_MPI_BANNER = """--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[5185,1],0]
  Exit code:    3
--------------------------------------------------------------------------
"""


def _filtered(text: str) -> str:
    f = BannerFilter()
    out = []
    for line in text.encode().splitlines(keepends=True):
        out += f.feed(line)
    return b"".join(out + f.flush()).decode()


def test_banner_filter_drops_termination_banners_only() -> None:
    kept = "[0] training\n[1] ======== user text ========\n"
    box = "=" * 30 + "\n= a box of the user's launcher wrapper\n" + "=" * 30 + "\n"
    assert _filtered(kept + MPICH_BANNER + "after\n") == kept + "after\n"
    assert _filtered(OPEN_MPI_BANNER + kept) == kept
    assert _filtered("[mpiexec@vm] Sending Ctrl-C to processes as requested\n"
                     "[mpiexec@vm] Press Ctrl-C again to force abort\n" + kept) == kept
    # A box that is not a termination banner, blank lines and unlabelled text pass unchanged.
    other = "\n" + box + "\nplain\n"
    assert _filtered(other) == other
    assert _filtered("=" * 25 + "\nunterminated") == "=" * 25 + "\nunterminated"


def test_interrupt_filter_drops_only_keyboard_interrupt_tracebacks() -> None:
    interrupt = ("Traceback (most recent call last):\n  File \"t.py\", line 3, in <module>\n"
                 "    time.sleep(60)\nKeyboardInterrupt\n")
    other = ("Traceback (most recent call last):\n  File \"t.py\", line 9, in <module>\n"
             "    save()\nOSError: disk full\n")
    chained = interrupt + ("\nDuring handling of the above exception, another exception "
                           "occurred:\n\n") + other
    f = InterruptTracebackFilter()
    assert f.feed(interrupt.encode()) == interrupt.encode()  # inactive: passes everything
    f.active = True
    data = ("saving...\n" + interrupt + other + chained + "bye\n").encode()
    # Fed in odd pieces, as pipes deliver it.
    out = b"".join(f.feed(data[i:i + 7]) for i in range(0, len(data), 7)) + f.flush()
    assert out.decode() == "saving...\n" + other + chained + "bye\n"
    f = InterruptTracebackFilter()
    f.active = True
    assert f.feed(b"prompt> ") == b"prompt> "  # a partial line is not held back
    assert f.feed(interrupt.encode()[:40]) == b"" and f.flush() == interrupt.encode()[:40]


def _note(tmp, rank: int, event: str, **extra) -> None:
    record = {"rank": rank, "host": f"h{rank}", "event": event, "time": time.time(), **extra}
    (tmp / f"rank.{rank}.{event}.note").write_text(json.dumps(record))


def test_culprit_for_uneven_steps_and_stall(tmp_path) -> None:
    fail0 = RankFailure(0, "h0", 1, time.time())
    # No notes: nothing to add, the first failure stays the headline.
    assert blame.culprit_line([fail0], blame.read_notes(str(tmp_path))) is None
    _note(tmp_path, 1, "finished")
    _note(tmp_path, 0, "error", message=f"Horovod has been shut down. ({blame.PEER_SHUTDOWN})")
    notes = blame.read_notes(str(tmp_path))
    assert [(n.rank, n.event) for n in notes] == [(1, "finished"), (0, "error")]
    assert blame.culprit_line([fail0], notes) == (
        "rank 1 (host h1) ended (the program called hvd.shutdown()) while rank 0 still waited "
        f"in a collective; {blame.UNEVEN_HINT}")
    # A rank that failed for another reason is its own culprit.
    other = [blame.Note(0, "h0", "error", 1.0, "HorovodInternalError: peer lost"),
             notes[0]]
    assert blame.culprit_line([fail0], other) is None
    stall = [blame.Note(0, "h0", "error", 1.0, f"shut down ({blame.STALL_SHUTDOWN})",
                        {2: ["allreduce.a", "allreduce.b"]})]
    assert blame.culprit_line([fail0], stall, {2: "h2"}) == (
        "rank 2 (host h2) did not submit allreduce.a, allreduce.b, which rank 0 waited for "
        "until the stall check shut the job down (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")
    # Only rank 0 has the report, and its own wait had not reached the limit yet: another
    # rank's error names the stall.
    split = [blame.Note(0, "h0", "error", 1.0, f"shut down ({blame.PEER_SHUTDOWN})",
                        {1: ["allreduce.a"]}),
             blame.Note(3, "h3", "error", 1.0, f"shut down ({blame.STALL_SHUTDOWN})")]
    assert blame.culprit_line([RankFailure(3, "h3", 1, 2.0)], split) == (
        "rank 1 did not submit allreduce.a, which ranks 0, 3 waited for until the stall "
        "check shut the job down (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")


def test_stall_report_parsing() -> None:
    from aiak_training.common.job.exit_guard import parse_missing_ranks
    report = ("One or more tensors were submitted ...\nMissing ranks:\n1: [allreduce.x, "
              "allreduce.y]\n3: [broadcast.w]\n")
    assert parse_missing_ranks(report) == {1: ["allreduce.x", "allreduce.y"],
                                           3: ["broadcast.w"]}
    assert parse_missing_ranks("no report") == {}


def test_exit_bound_is_armed_by_a_failure_and_cleared_by_a_clean_end(monkeypatch,
                                                                      tmp_path) -> None:
    from aiak_training.common.exceptions import HorovodInternalError
    from aiak_training.common.job import exit_guard
    monkeypatch.setattr(exit_guard, "_failure_at", None)
    monkeypatch.setattr(exit_guard, "_error_noted", False)
    monkeypatch.setenv("AIAK_FAILURE_DIR", str(tmp_path))
    monkeypatch.setenv("PMI_RANK", "4")
    assert not exit_guard.failed_since_clean_shutdown()
    exit_guard.note_shutdown(engine_running=True)  # a normal end: never bounded
    assert not exit_guard.failed_since_clean_shutdown()
    HorovodInternalError("Horovod has been shut down. (another rank shut down)")
    assert exit_guard.failed_since_clean_shutdown()
    exit_guard.note_shutdown(engine_running=False)  # the engine had stopped by itself
    assert exit_guard.failed_since_clean_shutdown()
    # An elastic reset: a new engine ran and the program then ended normally.
    exit_guard.note_shutdown(engine_running=True)
    assert not exit_guard.failed_since_clean_shutdown()
    notes = blame.read_notes(str(tmp_path))
    # One note per kind and process: the latest "finished" replaced the first.
    assert [(n.rank, n.event) for n in notes] == [(4, "error"), (4, "finished")]
    assert notes[0].message.endswith("(another rank shut down)")
    monkeypatch.setenv(exit_guard.EXIT_TIMEOUT_ENV, "0.5")
    assert exit_guard.exit_timeout() == 0.5
    monkeypatch.setenv(exit_guard.EXIT_TIMEOUT_ENV, "-1")
    with pytest.raises(ValueError, match="AIAK_EXIT_TIMEOUT_SECONDS"):
        exit_guard.exit_timeout()


def test_did_you_mean() -> None:
    known = ["-np", "--num-proc", "-H", "--hosts", "--fusion-threshold-mb", "--verbose"]
    assert suggest("--np", known) == "-np"
    assert suggest("--fusion-treshold-mb", known) == "--fusion-threshold-mb"
    assert suggest("--fusion-treshold-mb=3", known) == "--fusion-threshold-mb"
    assert suggest("--completely-different", known) is None


def test_usage_error_is_short_and_suggests() -> None:
    proc = subprocess.run(AIAKRUN + ["--np", "2", "true"], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "aiakrun: error: unrecognized arguments: --np",
        "aiakrun: --np: did you mean -np?",
        "aiakrun: run `aiakrun --help` for the list of flags"]


def test_mpi_found_beside_the_interpreter(tmp_path) -> None:
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    python = bindir / "python"
    python.write_text("")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MpiNotFoundError) as info:
        find_launcher({"PATH": str(empty)}, python=str(python))
    assert f"it looked in {bindir}, PATH={empty}" in str(info.value)
    mpiexec = bindir / "mpiexec"
    mpiexec.write_text("#!/bin/sh\n")
    mpiexec.chmod(0o755)
    on_path = empty / "mpirun"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    # Beside the interpreter wins over PATH, even over PATH's mpirun.
    assert find_launcher({"PATH": str(empty)}, python=str(python)) == str(mpiexec)


def test_aiakrun_by_path_without_the_venv_on_path(tmp_path) -> None:
    script = os.path.join(os.path.dirname(sys.executable), "aiakrun")
    if not os.path.isfile(script) or not any(
            os.path.isfile(os.path.join(os.path.dirname(sys.executable), n))
            for n in ("mpirun", "mpiexec")):
        pytest.skip("needs the aiakrun script and an MPI installed beside this interpreter "
                    f"({os.path.dirname(sys.executable)})")
    env = _env(PATH=str(tmp_path))  # no MPI, no python on PATH
    proc = subprocess.run([script, "-np", "2", sys.executable, "-c",
                           "import os; print('rank', os.environ['PMI_RANK'])"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"rank (\d)", proc.stdout)) == ["0", "1"]


def test_liveness_value_and_stray_connections() -> None:
    server = LivenessServer(local_only=True)
    try:
        token, addrs, port = parse_value(server.env_value())
        assert (token, addrs, port) == (server.token, ["127.0.0.1"], server.port)
        stray = socket.create_connection(("127.0.0.1", port), timeout=5)
        stray.sendall(b"wrong-token 5\n")
        good = socket.create_connection(("127.0.0.1", port), timeout=5)
        good.sendall(f"{token} 3\n".encode())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and server.ranks != [3]:
            time.sleep(0.02)
        assert server.ranks == [3]
        stray.settimeout(5)
        assert stray.recv(1) == b""  # dropped at once
        good.settimeout(0.2)
        with pytest.raises(socket.timeout):
            good.recv(1)  # held open
    finally:
        server.close()
    good.settimeout(5)
    assert good.recv(1) == b""
    for bad in ("x", "tok@:1", "tok@a:b"):
        with pytest.raises(ValueError):
            parse_value(bad)


# ------------------------------------------------------------------------------------------
# Jobs


def test_stuck_rank_after_stall_shutdown_ends_quickly(tmp_path) -> None:
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    proc = _start(["-np", "2", "--stall-check-warning-time-seconds", "2",
                   "--stall-check-shutdown-time-seconds", "5", sys.executable, SCRIPT, "stuck",
                   str(tmp_path), marker])
    started = _wait_ready(str(tmp_path), 2, proc)
    out, err = _finish(proc, timeout=60)
    ended = time.monotonic() - started
    assert ended < 15, (ended, err[-3000:])
    assert proc.returncode == 1, err[-3000:]
    assert "UNEXPECTED" not in out
    assert "rank 0: HorovodInternalError" in out
    lines = err.rstrip().splitlines()
    # Rank 0 did not wait for the sleeping rank in MPI_Finalize; the summary names rank 1.
    assert "rank 0: MPI_Finalize did not return within 3 s" in err
    # The cause closes the output; the ranks that ended because of it come before.
    assert lines[-2:] == [
        f"aiakrun: also: rank 0 (host {HOST}) exited with exit code 1",
        f"aiakrun: job failed: rank 1 (host {HOST}) did not submit allreduce.never_matched, "
        "which rank 0 waited for until the stall check shut the job down "
        "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS); the other ranks were stopped"], err[-3000:]
    assert "BAD TERMINATION" not in out + err
    assert processes_with(marker) == []


def test_uneven_steps_blame_the_rank_that_finished(tmp_path) -> None:
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    proc = _start(["-np", "2", sys.executable, SCRIPT, "uneven", str(tmp_path), marker])
    out, err = _finish(proc, timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "rank 1: ran 90 steps" in out and "rank 0: ran" not in out
    # Rank 1 was already in MPI_Finalize: rank 0's bounded exit did not need the bound.
    assert "MPI_Finalize did not return" not in err
    lines = err.rstrip().splitlines()
    assert lines[-2:] == [
        f"aiakrun: also: rank 0 (host {HOST}) exited with exit code 1",
        f"aiakrun: job failed: rank 1 (host {HOST}) ended (the program called "
        "hvd.shutdown()) while rank 0 still waited in a collective; the ranks ran different "
        "numbers of steps? Every rank must make the same collective calls: give each rank "
        "the same number of batches; the other ranks were stopped"], err[-3000:]
    assert "BAD TERMINATION" not in out + err
    assert processes_with(marker) == []


def test_failure_banner_hidden_unless_verbose() -> None:
    code = "import os, sys; sys.exit(3 if os.environ['PMI_RANK'] == '1' else 0)"
    quiet = subprocess.run(AIAKRUN + ["-np", "2", sys.executable, "-c", code], env=_env(),
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert quiet.returncode == 3
    assert "BAD TERMINATION" not in quiet.stdout + quiet.stderr
    assert quiet.stderr.rstrip().splitlines()[-1] == (
        f"aiakrun: job failed: rank 1 (host {HOST}) exited with exit code 3; "
        "the other ranks were stopped")
    raw = subprocess.run(AIAKRUN + ["--verbose", "-np", "2", sys.executable, "-c", code],
                         env=_env(), capture_output=True, text=True, timeout=60, cwd=REPO)
    assert raw.returncode == 3
    assert "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" in raw.stdout + raw.stderr


def test_ctrl_c_prints_one_line(tmp_path) -> None:
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    code = (f"import sys, time  # {marker}\n"
            "sys.stdout.write('ready\\n')\n"
            "def work():\n"
            "    time.sleep(120)\n"
            "work()\n")
    proc = _start(["-np", "2", sys.executable, "-c", code])
    try:
        ready, deadline = 0, time.monotonic() + 60
        while ready < 2 and time.monotonic() < deadline:
            ready += "ready" in proc.stdout.readline()
        assert ready == 2
        proc.send_signal(signal.SIGINT)
        out, err = _finish(proc, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT
    assert err.strip() == "aiakrun: stopped by SIGINT", err
    assert "Ctrl-C" not in out and "Traceback" not in out + err
    assert processes_with(marker) == []


def test_horovod_import_gets_a_hint() -> None:
    proc = subprocess.run(AIAKRUN + ["-np", "1", sys.executable, "-c",
                                     "import horovod.torch as hvd"],
                          env=_env(), capture_output=True, text=True, timeout=60, cwd=REPO)
    if "No module named 'horovod'" not in proc.stderr:
        pytest.skip("a real horovod is importable here")
    assert proc.returncode == 1
    assert proc.stderr.rstrip().splitlines()[-1].startswith(
        "aiakrun: hint: the program imports horovod, which is not installed here; run it "
        "with aiakrun --horovod-compat")
    compat = subprocess.run(AIAKRUN + ["--horovod-compat", "-np", "1", sys.executable, "-c",
                                       "import horovod.torch as hvd; print(hvd.__name__)"],
                            env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert compat.returncode == 0, compat.stderr
    assert "hint" not in compat.stderr


def test_rank_zero_says_what_is_on() -> None:
    code = ("import torch, aiak_training.torch as hvd; hvd.init(); "
            "m = torch.nn.Linear(2, 2); "
            "hvd.DistributedOptimizer(torch.optim.Adam(m.parameters()), "
            "named_parameters=m.named_parameters(), compression=hvd.Compression.fp16)")
    proc = subprocess.run(AIAKRUN + ["-np", "2", "--overlap-update", "--fused-optimizer",
                                     sys.executable, "-c", code],
                          env=_env(), capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    start = [ln for ln in proc.stderr.splitlines() if "[aiak_training INFO] transport " in ln]
    assert len(start) == 1 and start[0].startswith("[0] "), proc.stderr
    assert re.search(r"transport MPI \(\w+.*\); GPU collectives \w+; "
                     r"allreduce flat \(AIAK_ALLREDUCE_ALGO=auto, but there is a single node; "
                     r"1 node\(s\), 2 rank\(s\)\); accelerations: overlap update "
                     r"\(AIAK_OVERLAP_UPDATE\), fused optimizer \(AIAK_FUSED_OPTIMIZER\)$",
                     start[0]), start
    opt = [ln for ln in proc.stderr.splitlines() if "DistributedOptimizer(" in ln]
    assert opt == ["[0] [aiak_training INFO] DistributedOptimizer(FusedAdam): compression "
                   "fp16, overlap update on, fused optimizer on"], proc.stderr


def _survivors(pids: List[int], since: float, limit: float = 10) -> List[int]:
    """Those of ``pids`` still alive ``limit`` seconds after ``since`` (sooner if all end)."""
    left = pids
    while left and time.monotonic() - since < limit:
        time.sleep(0.1)
        left = [p for p in left if proc_tree.is_alive(p)]
    return left


def test_sigkill_of_aiakrun_leaves_nothing(tmp_path) -> None:
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    proc = _start(["-np", "2", sys.executable, SCRIPT, "train", str(tmp_path), marker])
    try:
        _wait_ready(str(tmp_path), 2, proc)
        job = proc_tree.descendants(proc.pid)
        assert len(job) >= 5, job  # launcher, proxy, 2 wrappers, 2 ranks
        proc.kill()
        killed = time.monotonic()
        proc.communicate(timeout=30)
        left = _survivors(job, killed)
        assert left == [], [open(f"/proc/{p}/cmdline", "rb").read() for p in left]
        assert processes_with(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc_tree.kill_all(processes_with(marker))


def test_liveness_stops_ranks_when_launcher_cannot(tmp_path) -> None:
    # The MPI launcher is frozen (SIGSTOP: the SIGTERM it gets when aiakrun dies stays
    # pending, and its proxies see no end of their connection), so only the wrappers'
    # liveness connections can stop the ranks once aiakrun is SIGKILLed.
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    proc = _start(["-np", "2", sys.executable, SCRIPT, "train", str(tmp_path), marker])
    launcher = None
    try:
        _wait_ready(str(tmp_path), 2, proc)
        (launcher,) = proc_tree.children(proc.pid)
        job = [p for p in proc_tree.descendants(proc.pid) if p != launcher]
        os.kill(launcher, signal.SIGSTOP)
        proc.kill()
        killed = time.monotonic()
        proc.communicate(timeout=30)
        left = _survivors(job, killed)
        assert left == [], [open(f"/proc/{p}/cmdline", "rb").read() for p in left]
        assert [p for p in processes_with(marker) if p != launcher] == []
    finally:
        if launcher is not None:
            proc_tree.kill_all([launcher], signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc_tree.kill_all(processes_with(marker))


# ------------------------------------------------------------------------------------------
# On the emulated cluster (root and network namespaces)


def test_sigkill_of_aiakrun_on_the_emulated_cluster(tmp_path) -> None:
    require_emulation()
    from aiak_training.testing.cluster import EmulatedCluster, leftovers
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    with EmulatedCluster(2, 2, "1gbit", verify="off", log=None) as cluster:
        prefix = cluster.prefix
        result: dict = {}

        def run() -> None:
            try:
                result["proc"] = cluster.run(
                    AIAKRUN + ["-np", "4", sys.executable, SCRIPT, "train", str(tmp_path),
                               marker], env=_env(), timeout=150, reap=False,
                    capture_output=True, text=True)
            except BaseException as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and thread.is_alive() and not all(
                os.path.exists(os.path.join(tmp_path, f"ready.{r}")) for r in range(4)):
            time.sleep(0.1)
        assert all(os.path.exists(os.path.join(tmp_path, f"ready.{r}")) for r in range(4)), \
            result
        launchers = [p for p in processes_with(marker) if p in netns_pids(cluster.namespaces[0])
                     and b"runner.launch" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(launchers) == 1, launchers
        # Both nodes run processes of the job: the remote node's proxy, wrappers and ranks.
        assert netns_pids(cluster.namespaces[1])
        os.kill(launchers[0], signal.SIGKILL)
        killed = time.monotonic()
        left = [1]
        while left and time.monotonic() - killed < 10:
            time.sleep(0.1)
            left = [p for ns in cluster.namespaces for p in netns_pids(ns)
                    if proc_tree.is_alive(p)]
        thread.join(timeout=30)
        assert left == [], [(p, open(f"/proc/{p}/cmdline", "rb").read()) for p in left]
        assert processes_with(marker) == []
    assert prefix and leftovers(prefix) == []


# ------------------------------------------------------------------------------------------
# The cause in the summary (issue 30)

SHUT_DOWN_TB = (
    "Traceback (most recent call last):\n"
    "  File \"train.py\", line 6, in <module>\n"
    "    hvd.allreduce(torch.ones(3), name=\"x\")\n"
    "  File \"/x/aiak_training/runtime/entries.py\", line 143, in wait\n"
    "    raise HorovodInternalError(h.error)\n"
    "aiak_training.common.exceptions.HorovodInternalError: Horovod has been shut down. This "
    "was caused by an exception on one of the ranks\n")
BOOM_TB = ("Traceback (most recent call last):\n"
           "  File \"train.py\", line 5, in <module>\n"
           "    raise ValueError(\"boom\")\n"
           "ValueError: boom\n")


def test_traceback_watch_notes_the_exception_and_cuts_secondary_tracebacks() -> None:
    from aiak_training.runner.report.rank_traceback import CUT_NOTE, TracebackWatch
    watch = TracebackWatch()
    data = ("epoch 1\n" + SHUT_DOWN_TB + "after\n").encode()
    # Fed in odd pieces, as pipes deliver it.
    out = b"".join(watch.feed(data[i:i + 5]) for i in range(0, len(data), 5)) + watch.flush()
    secondary = ("aiak_training.common.exceptions.HorovodInternalError: Horovod has been shut "
                 "down. This was caused by an exception on one of the ranks")
    assert out.decode() == "epoch 1\n" + secondary + CUT_NOTE.decode() + "\nafter\n"
    assert watch.last.secondary
    assert watch.last.line == ("HorovodInternalError: Horovod has been shut down. This was "
                               "caused by an exception on one of the ranks")
    before = time.time()
    # Any other traceback passes whole; the latest exception (of a chain: the last) counts.
    chained = BOOM_TB + "\nDuring handling of the above exception, another exception " \
                        "occurred:\n\n" + BOOM_TB.replace("ValueError: boom", "pkg.mod.Oops: x")
    assert watch.feed(chained.encode()) + watch.flush() == chained.encode()
    assert (watch.last.line, watch.last.secondary) == ("Oops: x", False)
    assert before <= watch.last.time <= time.time()
    assert watch.feed(b"prompt> ") == b"prompt> "  # a partial line that is no traceback


def test_first_cause_is_the_earliest_own_failure() -> None:
    import io
    from aiak_training.runner.guard.supervise import JobResult, report
    from aiak_training.runner.report.failure import first_cause
    # Rank 0 ended first, on the consequence; rank 1 raised earlier but ended later (it
    # waited in MPI_Finalize), rank 2 was killed after rank 1 raised.
    victim = RankFailure(0, "h0", 1, 10.0, exception="HorovodInternalError: Horovod has been "
                         "shut down.", raised_at=9.5, secondary=True)
    raised = RankFailure(1, "h1", 1, 12.0, exception="ValueError: boom", raised_at=9.0)
    killed = RankFailure(2, "h2", -9, 11.0)
    assert first_cause([victim, killed, raised]) is raised
    assert first_cause([victim, RankFailure(2, "h2", -9, 8.0), raised]).rank == 2
    # A killed rank's peers may print their broken-connection errors a moment before its
    # wrapper sees it end: a signal within SIGNAL_LEAD_S of an exception still comes first.
    peer_error = RankFailure(0, "h0", 1, 9.2, exception="RuntimeError: Connection closed by "
                             "peer", raised_at=9.0)
    assert first_cause([peer_error, RankFailure(1, "h1", -9, 9.5)]).rank == 1
    # An exit code is no signal: a rank that raised 0.5 s before another exited 1 is first.
    assert first_cause([peer_error, RankFailure(1, "h1", 1, 9.5)]) is peer_error
    assert first_cause([victim]) is victim and first_cause([]) is None
    assert raised.describe() == "rank 1 (host h1) raised ValueError: boom (exit code 1)"
    assert victim.describe() == "rank 0 (host h0) exited with exit code 1"
    out = io.StringIO()
    report(JobResult(1, 1, [victim, killed, raised]), "mpiexec", out)
    assert out.getvalue().splitlines() == [
        "aiakrun: also: rank 0 (host h0) exited with exit code 1",
        "aiakrun: also: rank 2 (host h2) exited with signal SIGKILL",
        "aiakrun: job failed: rank 1 (host h1) raised ValueError: boom (exit code 1); the "
        "other ranks were stopped"]


def test_start_watch_declares_the_ranks_that_never_arrived(tmp_path) -> None:
    from aiak_training.common.job.records import drop_record
    from aiak_training.common.job.records import read_failures, write_failure
    from aiak_training.runner.guard.start_watch import StartWatch, start_timeout
    assert start_timeout({"HOROVOD_START_TIMEOUT": "30"}) == 30.0
    assert start_timeout({"HOROVOD_START_TIMEOUT": "0"}) is None
    assert start_timeout({}) is None and start_timeout({"HOROVOD_START_TIMEOUT": "x"}) is None
    d = str(tmp_path)
    watch = StartWatch(d, {0: "a", 1: "a", 2: "b"}, 5.0, "MPI_Init")
    assert not watch.check(wall_now=1e12, force_read=True)  # nobody arrived: nothing timed
    drop_record(d, "rank.0.1", ".arrival", {"rank": 0, "host": "a", "time": 100.0})
    drop_record(d, "rank.2.1", ".arrival", {"rank": 2, "host": "b", "time": 101.0})
    assert not watch.check(wall_now=104.9, force_read=True)
    assert read_failures(d) == []
    assert watch.check(wall_now=105.0, force_read=True)
    assert [f.describe() for f in read_failures(d)] == [
        "rank 1 (host a) did not reach MPI_Init (hvd.init()) within HOROVOD_START_TIMEOUT=5 s "
        "after rank 0 did (still starting, stuck before hvd.init(), or ended without calling "
        "it)"]
    assert read_failures(d)[0].time == 105.0  # the deadline, which came before any fallout
    assert not watch.check(wall_now=200.0, force_read=True)  # declared once
    # A rank that failed by itself before arriving is not declared again.
    other = tmp_path / "other"
    other.mkdir()
    write_failure(str(other), RankFailure(1, "a", 1, 102.0, exception="ImportError: x", raised_at=1.0))
    drop_record(str(other), "rank.0.1", ".arrival", {"rank": 0, "host": "a", "time": 100.0})
    assert not StartWatch(str(other), {0: "a", 1: "a"}, 5.0, "MPI_Init").check(
        wall_now=200.0, force_read=True)


BOOM = ("import torch, aiak_training.torch as hvd\n"
        "hvd.init()\n"
        "if hvd.rank() == 1:\n"
        "    raise ValueError('boom')\n"
        "hvd.allreduce(torch.ones(3), name='x')\n")


@pytest.mark.parametrize("mode", [pytest.param([], id="mpi"), pytest.param(["--gloo"],
                                                                             id="gloo")])
def test_exception_is_the_last_line_and_output_is_short(mode, tmp_path) -> None:
    script = tmp_path / "boom.py"
    script.write_text(BOOM)
    proc = subprocess.run(AIAKRUN + mode + ["-np", "2", sys.executable, str(script)],
                          env=_env(), capture_output=True, text=True, timeout=180, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    lines = proc.stderr.rstrip().splitlines()
    host = "localhost" if mode else HOST
    assert lines[-1] == (f"aiakrun: job failed: rank 1 (host {host}) raised ValueError: boom "
                         "(exit code 1); the other ranks were stopped"), output
    assert len(output.rstrip().splitlines()) <= 25, output
    # The cause's traceback is shown once, whole; rank 0's consequence in one line.
    assert output.count("Traceback (most recent call last):") == 1, output
    assert "[1]     raise ValueError('boom')" in output
    assert len([ln for ln in output.splitlines() if ln.startswith("[0]")
                and "HorovodInternalError: Horovod has been shut down" in ln
                and ln.endswith("[traceback not shown: a consequence of another rank's "
                                "failure]")]) == 1, output


def test_collective_mismatch_is_repeated_in_the_last_line() -> None:
    code = ("import torch, aiak_training.torch as hvd\n"
            "hvd.init()\n"
            "hvd.allreduce(torch.ones(3 + hvd.rank()), name='x')\n")
    proc = subprocess.run(AIAKRUN + ["-np", "2", sys.executable, "-c", code], env=_env(),
                          capture_output=True, text=True, timeout=180, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr
    assert re.fullmatch(
        rf"aiakrun: job failed: rank [01] \(host {HOST}\) raised HorovodInternalError: "
        r"Mismatched allreduce tensor shapes on tensor allreduce\.x: one rank sent a tensor of "
        r"shape \[3\], but another rank sent a tensor of shape \[4\]\. \(exit code 1\); the "
        r"other ranks were stopped", proc.stderr.rstrip().splitlines()[-1]), proc.stderr


LATE = ("import os, sys, time\n"
        "if os.environ.get('HOROVOD_RANK', os.environ.get('PMI_RANK')) == '1':\n"
        "    time.sleep(300)  # {marker}\n"
        "import aiak_training.torch as hvd\n"
        "hvd.init()\n"
        "print('UNEXPECTED: init returned', flush=True)\n")


@pytest.mark.parametrize("mode", [pytest.param([], id="mpi"), pytest.param(["--gloo"],
                                                                             id="gloo")])
def test_rank_that_never_arrives_ends_the_job(mode, tmp_path) -> None:
    marker = f"aiak_marker_{uuid.uuid4().hex}"
    # aiakrun's run directory goes under tmp_path (TMPDIR), where the test can watch it.
    proc = _start(mode + ["--start-timeout", "4", "-np", "2", sys.executable, "-c",
                          LATE.format(marker=marker)], env=_env(TMPDIR=str(tmp_path)))
    arrived_at = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and arrived_at is None:
        # Rank 0's arrival note starts the clock.
        if any(n.endswith(".arrival") for _, _, names in os.walk(tmp_path) for n in names):
            arrived_at = time.monotonic()
        time.sleep(0.05)
    out, err = _finish(proc, timeout=60)
    assert arrived_at is not None, err
    ended = time.monotonic() - arrived_at
    assert proc.returncode == 1, err
    stage = "the Gloo rendezvous" if mode else "MPI_Init"
    host = "localhost" if mode else HOST
    assert err.rstrip().splitlines()[-1] == (
        f"aiakrun: job failed: rank 1 (host {host}) did not reach {stage} (hvd.init()) within "
        "HOROVOD_START_TIMEOUT=4 s after rank 0 did (still starting, stuck before hvd.init(), "
        "or ended without calling it); the other ranks were stopped"), err
    assert ended < 4 + 10, ended
    assert "UNEXPECTED" not in out
    assert processes_with(marker) == []
