"""Launch tests/parallel/test_scale_factors.py (Horovod's pre/postscale and Average
arithmetic, bit for bit) at 2, 3 and 4 ranks: 1/3 is inexact, 1/2 and 1/4 are not."""
import sys

import pytest

from launch import check_rank_summaries, run_ranks

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
          "tests/parallel", "tests/parallel/test_scale_factors.py"]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_scale_factors_match_horovod(ranks):
    proc = run_ranks([ranks], PYTEST)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, ranks, 171)
