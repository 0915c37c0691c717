"""TensorFlow fidelity to Horovod 0.28.1 (tests/parallel/test_tf_fidelity.py): error classes
in eager, tf.function and tf.compat.v1 graphs, broadcast_ on RefVariables, the TF1 graph
API; and hvd.init(process_sets=...) (tests/scripts/tf_process_sets_init.py).  At 2 ranks,
and the key ones at 4."""
import importlib.util
import subprocess
import sys

import pytest

from launch import REPO, check_rank_summaries, env_with, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="TensorFlow is not installed (pip install -e '.[tensorflow]')")

PER_RANK = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "-W", "ignore::DeprecationWarning", "--rootdir", "tests/parallel",
            "tests/parallel/test_tf_fidelity.py"]
ENV = {"AIAK_TEST_FRONTEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize("ranks", [2, 4])
def test_tf_fidelity_per_rank_suite(ranks):
    proc = run_ranks([ranks], PER_RANK, env=ENV)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, ranks, 6)


@pytest.mark.parametrize("ranks", [2, 4])
def test_init_process_sets_duplicates_and_reinit(ranks):
    proc = run_ranks([ranks], [sys.executable, "tests/scripts/tf_process_sets_init.py"],
                     env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("process_sets init ok") == ranks, proc.stdout[-4000:]


def test_graph_collectives_still_fail_clearly_without_a_compiler(tmp_path):
    """Where the status op cannot be built (no C++ compiler), graph collectives still run
    and still fail, as tf.errors.UnknownError carrying the message; a warning says why."""
    code = """
import logging, tensorflow as tf
import aiak_training.tensorflow as hvd
from aiak_training.tensorflow.errors import status_op_module
hvd.init()
assert status_op_module() is None
out = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum) + 1.0)(tf.ones([3]))
assert out.numpy().tolist() == [2.0, 2.0, 2.0], out
print("fallback ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, timeout=300,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env=env_with({**ENV, "CXX": "/bin/false",
                                        "AIAK_TF_OP_CACHE": str(tmp_path)}))
    assert proc.returncode == 0 and "fallback ok" in proc.stdout, proc.stdout[-3000:]
    assert "status op could not be built" in proc.stdout, proc.stdout[-3000:]
