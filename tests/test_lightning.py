"""The Lightning 2 strategy (aiak_training.lightning): its per-rank suite at 2 ranks under
mpiexec, and examples/lightning_digits.py under aiakrun.

Lightning is optional (the ``lightning`` extra): without it these tests are skipped.
"""
import importlib.util
import re
import subprocess
import sys

import pytest

from launch import REPO, check_rank_summaries, env_with, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="Lightning is not installed (pip install -e '.[lightning]')")

PER_RANK = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "-W", "ignore::DeprecationWarning", "--rootdir", "tests/parallel",
            "tests/parallel/test_lightning.py"]


def test_lightning_per_rank_suite(tmp_path):
    proc = run_ranks([2], PER_RANK, env={"AIAK_TEST_TMPDIR": str(tmp_path)}, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, 2, minimum=10)


def test_lightning_digits_example_trains_on_two_ranks():
    proc = subprocess.run(["aiakrun", "-np", "2", sys.executable, "examples/lightning_digits.py",
                           "--epochs", "3"], cwd=REPO, env=env_with(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.findall(r"test accuracy: ([0-9.]+)% \((\d+)/450\)", proc.stdout)
    assert len(found) == 1, proc.stdout[-3000:]  # rank 0 prints it once, the ranks agreed
    # Three epochs of the digits MLP reach about 90% (15 epochs: about 97%).
    assert float(found[0][0]) > 80.0, proc.stdout[-3000:]
