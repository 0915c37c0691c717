"""The coordinator round of the C++ engine's negotiation (csrc/engine/controller.cpp): request
lists padded to the width the bit vector agreed on, responses split over two broadcasts past
4 KiB, over MPI and over Gloo."""
import subprocess
import sys

import pytest

from launch import REPO, env_with, run_ranks

SCRIPT = [sys.executable, "tests/scripts/negotiation_widths.py"]


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_uneven_request_lists_and_long_responses(transport):
    if transport == "mpi":
        proc = run_ranks([2], SCRIPT, timeout=300)
    else:
        proc = subprocess.run([sys.executable, "-m", "aiak_training.runner.launch", "--gloo",
                               "-np", "2", *SCRIPT], env=env_with(None), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("negotiation widths ok") == 2, proc.stdout[-4000:]
