"""Launch tests/parallel/test_overlap.py (overlap_update, issue 6) under MPI.

2 ranks run the whole file (equivalence, ordering, accounting, every fallback, the engine's
wait_any); 4 ranks run the equivalence, ordering and accounting tests again.  A small fusion
threshold makes the engine complete gradients in several buckets per cycle, so the overlapped
step really sees partial completions (the tests also force one handle per bucket on half the
steps).
"""
import sys

import pytest

from launch import check_rank_summaries, run_ranks

# faulthandler_timeout: a hung test prints every thread's stack instead of dying silently.
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
          "-o", "faulthandler_timeout=100", "--rootdir", "tests/parallel",
          "tests/parallel/test_overlap.py"]
ENV = {"HOROVOD_FUSION_THRESHOLD": "2048", "AIAK_ZERO_COPY_BYTES": "512",
       "AIAK_OVERLAP_MIN_BUCKET_BYTES": "0"}

LAYOUTS = {
    "2ranks_all": (2, []),
    "4ranks_equivalence": (4, ["-k", "bitwise_equal_to or averaged_gradient or exactly_once"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlap_per_rank_suite(layout):
    nranks, extra = LAYOUTS[layout]
    proc = run_ranks([nranks], PYTEST + extra, env=ENV, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, nranks, 40 if nranks == 2 else 20)
