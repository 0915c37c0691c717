"""Launch the DGC per-rank suites (tests/parallel/test_dgc*.py) under mpiexec.

The 4-rank launch also runs the convergence test on digits (4 ranks, 3 seeds), in the same
pytest session to save a launch.
"""
import re
import sys

import pytest

from launch import check_rank_summaries, run_ranks

PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
          "--rootdir", "tests/parallel"]


def _run(nranks, files, minimum, timeout=600):
    proc = run_ranks([nranks], PYTEST + files, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, nranks, minimum)
    return proc.stdout


@pytest.mark.parametrize("nranks", [1, 2])
def test_dgc_per_rank_suite(nranks):
    _run(nranks, ["tests/parallel/test_dgc.py"], 32)


def test_dgc_per_rank_suite_and_digits_convergence_4_ranks():
    out = _run(4, ["tests/parallel/test_dgc.py", "tests/parallel/test_dgc_convergence.py", "-s"],
               35)
    for line in re.findall(r"^DIGITS .*$", out, re.M):  # the accuracies, for the record
        print(line)
