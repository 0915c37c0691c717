"""Launch the per-rank suites at 1, 2 and 4 ranks and on 2 virtual nodes x 2 ranks."""
import datetime
import re
import sys
import time

import pytest

from launch import check_rank_summaries, run_ranks

PER_RANK = ["tests/parallel/test_torch_ops.py", "tests/parallel/test_torch_optimizer.py"]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
          "--rootdir", "tests/parallel"]

# name: (ranks per node, virtual nodes, environment); BOTH_FILES below run both files.
LAYOUTS = {
    "1rank": ([1], False, {}),
    "2ranks": ([2], False, {}),
    "4ranks": ([4], False, {}),
    "2x2_virtual_nodes": ([2, 2], True, {"AIAK_TEST_LAYOUT": "2,2"}),
    "2+1_virtual_nodes": ([2, 1], True, {"AIAK_TEST_LAYOUT": "2,1"}),
    # Tiny fusion buffer and cache: exercises eviction, renegotiation and mixed
    # fused / in-place paths.
    "2ranks_tiny_fusion_and_cache": ([2], False, {"HOROVOD_FUSION_THRESHOLD": "4096",
                                                  "HOROVOD_CACHE_CAPACITY": "3",
                                                  "AIAK_ZERO_COPY_BYTES": "256"}),
    "2ranks_no_cache_no_fusion": ([2], False, {"HOROVOD_FUSION_THRESHOLD": "0",
                                               "HOROVOD_CACHE_CAPACITY": "0"}),
    # MPI_THREAD_SERIALIZED instead of MULTIPLE: only the engine's thread calls MPI.
    "2ranks_mpi_threads_disabled": ([2], False, {"HOROVOD_MPI_THREADS_DISABLE": "1"}),
}
BOTH_FILES = ("1rank", "2ranks", "4ranks", "2x2_virtual_nodes")
# Tests each rank passes: both files (one rank skips the mismatch tests), test_torch_ops.py.
PASSES_BOTH, PASSES_BOTH_ONE_RANK, PASSES_OPS = 178, 170, 159


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_rank_suite(layout):
    nodes, virtual, env = LAYOUTS[layout]
    both = layout in BOTH_FILES
    files = PER_RANK if both else PER_RANK[:1]
    proc = run_ranks(nodes, PYTEST + files, env=env, virtual_hosts=virtual)
    assert proc.returncode == 0, proc.stdout[-6000:]
    minimum = (PASSES_BOTH if sum(nodes) > 1 else PASSES_BOTH_ONE_RANK) if both else PASSES_OPS
    check_rank_summaries(proc.stdout, sum(nodes), minimum)


def test_killed_rank_fails_every_process_quickly():
    start = time.monotonic()
    proc = run_ranks([4], [sys.executable, "tests/scripts/kill_rank.py"], timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert elapsed < 60, elapsed
    assert "rank 1 killing itself" in proc.stdout
    assert "UNEXPECTED" not in proc.stdout


def test_stall_inspector_names_missing_rank():
    proc = run_ranks([2], [sys.executable, "tests/scripts/stall.py", "warn"],
                     env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "Missing ranks:" in proc.stdout
    assert re.search(r"^1: \[allreduce\.stalled\]", proc.stdout, re.M), proc.stdout[-3000:]
    # One report per interval (each rank's clock used to ask for its own), and rank 1, which
    # computed for 3.5 times the warning time, was not taken for a deadlock.
    stamps = [datetime.datetime.strptime(m, "%Y-%m-%d %H:%M:%S,%f") for m in re.findall(
        r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) aiak_training WARNING\] One or more tensors",
        proc.stdout)]
    assert stamps, proc.stdout[-3000:]
    gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]
    assert all(gap > 0.5 for gap in gaps), gaps
    assert "deadlock: " not in proc.stdout


def test_stall_shutdown_raises_on_every_rank():
    proc = run_ranks([2], [sys.executable, "tests/scripts/stall.py", "shutdown"],
                     env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
                          "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2",
                          # Horovod's rule alone: here the deadlock check would end it first.
                          "AIAK_DEADLOCK_SHUTDOWN": "0"}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count("stall shutdown raised HorovodInternalError") == 2, proc.stdout


def test_calls_before_init_raise_value_error():
    proc = run_ranks([1], [sys.executable, "tests/scripts/before_init.py"], timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.strip().endswith("before-init checks passed")
