"""Two Horovod fidelity points (issue 30), each run by its per-rank suite at 2 ranks:

* ``reducescatter(..., op=Adasum)`` raises Horovod's RuntimeError for every dtype, on the
  torch, TensorFlow and Keras 3 frontends (tests/parallel/test_reducescatter_adasum.py);
* ``backward_passes_per_step`` > 1 under Keras 2 (tf_keras) with its current and its legacy
  optimizers (tests/parallel/test_keras2_aggregation.py).
"""
import importlib.util
import sys

import pytest

from launch import check_rank_summaries, run_ranks

PER_RANK = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "-W", "ignore::DeprecationWarning", "--rootdir", "tests/parallel"]
QUIET_TF = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _needs(*modules: str) -> None:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")


def test_reducescatter_adasum_refused_on_torch_and_keras_torch():
    _needs("keras")
    proc = run_ranks([2], PER_RANK + ["tests/parallel/test_reducescatter_adasum.py"],
                     env={"KERAS_BACKEND": "torch", **QUIET_TF})
    assert proc.returncode == 0, proc.stdout[-6000:]
    # 8 dtypes on torch, 3 through Keras on torch; the TensorFlow ones skip.
    assert check_rank_summaries(proc.stdout, 2, 11) == 11


def test_reducescatter_adasum_refused_on_tensorflow_and_keras_tensorflow():
    _needs("tensorflow", "keras")
    proc = run_ranks([2], PER_RANK + ["tests/parallel/test_reducescatter_adasum.py"],
                     env={"AIAK_TEST_FRONTEND": "tensorflow", "KERAS_BACKEND": "tensorflow",
                          **QUIET_TF})
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert check_rank_summaries(proc.stdout, 2, 11) == 11


def test_keras2_gradient_aggregation_with_current_and_legacy_optimizers():
    _needs("tensorflow", "tf_keras")
    proc = run_ranks([2], PER_RANK + ["tests/parallel/test_keras2_aggregation.py"],
                     env={"TF_USE_LEGACY_KERAS": "1", "AIAK_TEST_FRONTEND": "tensorflow",
                          **QUIET_TF}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    # 12 aggregation cases, 2 inf, 2 sparse_as_dense, 8 partial, 1 without aggregation.
    assert check_rank_summaries(proc.stdout, 2, 25) == 25
