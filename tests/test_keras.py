"""The Keras 3 frontends (aiak_training.keras, aiak_training.tensorflow.keras): the per-rank
suite at 2 ranks on the TensorFlow and on the torch backend, and the two digits examples;
and Keras 2 (tf_keras with TF_USE_LEGACY_KERAS=1): its per-rank suite at 2 ranks.

Keras and its backends are optional: without them these tests are skipped.  Importing
TensorFlow costs seconds per process, so each launch runs a whole suite once.
"""
import importlib.util
import re
import sys

import pytest

from launch import check_rank_summaries, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("keras") is None,
                                reason="Keras 3 is not installed (pip install -e '.[tensorflow]')")

PER_RANK = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "-W", "ignore::DeprecationWarning", "--rootdir", "tests/parallel",
            "tests/parallel/test_keras.py"]
QUIET_TF = {"TF_CPP_MIN_LOG_LEVEL": "2"}
# Per backend: what it needs, and the environment of its ranks.  On TensorFlow the test
# session initializes through aiak_training.tensorflow, so its processes never load torch.
BACKENDS = {
    "tensorflow": ("tensorflow", {"KERAS_BACKEND": "tensorflow",
                                  "AIAK_TEST_FRONTEND": "tensorflow", **QUIET_TF}),
    "torch": ("torch", {"KERAS_BACKEND": "torch", **QUIET_TF}),
}
# Tests each rank passes, per backend.
PASSES = {"tensorflow": 14, "torch": 13}


def _needs(module: str):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_keras_per_rank_suite(backend, tmp_path):
    module, env = BACKENDS[backend]
    _needs(module)
    proc = run_ranks([2], PER_RANK, env={**env, "AIAK_TEST_TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, 2, PASSES[backend])


def test_keras2_tf_keras_per_rank_suite(tmp_path):
    """The Keras 2 suite (tests/parallel/test_keras2.py): TF_USE_LEGACY_KERAS=1 makes
    tf.keras resolve to tf_keras, and aiak_training's Keras frontends serve Keras 2."""
    _needs("tensorflow")
    _needs("tf_keras")
    proc = run_ranks([2], PER_RANK[:-1] + ["tests/parallel/test_keras2.py"],
                     env={**BACKENDS["tensorflow"][1], "TF_USE_LEGACY_KERAS": "1",
                          "AIAK_TEST_TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, 2, 9)


def _accuracy(stdout: str) -> float:
    found = re.findall(r"test accuracy: ([0-9.]+)%", stdout)
    assert len(found) == 1, stdout[-3000:]  # printed by rank 0 only
    return float(found[0])


@pytest.mark.parametrize("script", ["examples/keras_digits.py",
                                    "examples/tensorflow2_digits.py"])
def test_digits_examples_train_at_two_ranks(script):
    _needs("tensorflow")
    _needs("sklearn")
    proc = run_ranks([2], [sys.executable, script],
                     env={"KERAS_BACKEND": "tensorflow", **QUIET_TF}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert _accuracy(proc.stdout) > 93.0, proc.stdout[-3000:]
