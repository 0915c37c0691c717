"""Launch tests/parallel/test_sharded_optimizer.py (shard_optimizer_state=True, issue 32).

One process, and 2 and 4 ranks under MPI, run the whole file; 4 ranks laid out as 2 virtual
nodes (MPI, and Gloo through aiakrun --gloo) and 2 ranks over Gloo run the exactness,
checkpoint and allgather-overlap tests.  A 200-byte bucket limit makes several buckets whose shards cut through
parameters.
"""
import re
import subprocess
import sys

import pytest

from launch import REPO, check_rank_summaries, env_with, run_ranks

PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
          "-o", "faulthandler_timeout=120", "--rootdir", "tests/parallel",
          "tests/parallel/test_sharded_optimizer.py"]
ENV = {"AIAK_SHARD_BUCKET_BYTES": "200"}
SUBSET = ["-k", "equal_dense or sum_and_backward or consolidated or loads_into or "
          "overlapped or read_after_step"]


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_sharded_suite_mpi(nranks):
    proc = run_ranks([nranks], PYTEST, env=ENV, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, nranks, 30)


def test_sharded_exactness_2x2_virtual_nodes():
    proc = run_ranks([2, 2], PYTEST + SUBSET, env=ENV, virtual_hosts=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, 4, 10)


@pytest.mark.parametrize("layout", ["2ranks", "2x2"])
def test_sharded_over_gloo(layout):
    args = ["-np", "2"] if layout == "2ranks" else \
        ["-np", "4", "-H", "node0:2,node1:2", "--virtual-hosts"]
    n = 2 if layout == "2ranks" else 4
    cmd = [sys.executable, "-m", "aiak_training.runner.launch", "--gloo", *args, *PYTEST,
           *SUBSET]
    proc = subprocess.run(cmd, env=env_with(ENV), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, n, 10)
    for rank in range(n):  # aiakrun --gloo labels each line with its rank
        assert re.search(rf"^\[{rank}\] .*\d+ passed", proc.stdout, re.M), proc.stdout[-3000:]
    assert "mpiexec" not in proc.stdout
