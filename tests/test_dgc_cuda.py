"""Launch tests/parallel/test_dgc_cuda.py (DGC and the overlapped update with CUDA gradients):
1 rank on NCCL, and 2 ranks sharing one GPU (the staged path).  Needs a GPU; skipped
without one."""
import sys

import pytest
import torch

from launch import check_rank_summaries, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (torch.cuda.is_available() is False)")

SUITE = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "--rootdir", "tests/parallel", "tests/parallel/test_dgc_cuda.py"]
LAYOUTS = {"1rank": ([1], {}), "2ranks_one_gpu": ([2], {"CUDA_VISIBLE_DEVICES": "0"})}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dgc_cuda_suite(layout):
    nodes, env = LAYOUTS[layout]
    proc = run_ranks(nodes, SUITE, env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    # tests/parallel/test_dgc_cuda.py's 9 tests, less the one that needs a second GPU.
    check_rank_summaries(proc.stdout, sum(nodes), 8)
