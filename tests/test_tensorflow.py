"""The TensorFlow frontend: the per-rank suite at 1, 2 and 4 ranks and on 2 virtual nodes x
2 ranks, plus single-process checks (frontends stay apart, calls before init).

TensorFlow is optional: without it (and Keras) these tests are skipped.  Importing it costs
seconds per process, so each launch runs the whole per-rank suite once.
"""
import importlib.util
import subprocess
import sys
import textwrap

import pytest

from launch import REPO, check_rank_summaries, env_with, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="TensorFlow and Keras are not installed (pip install -e '.[tensorflow]')")

PER_RANK = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "--rootdir", "tests/parallel", "tests/parallel/test_tf_ops.py"]
FRONTEND = {"AIAK_TEST_FRONTEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}

LAYOUTS = {
    "1rank": ([1], False, {}),
    # One inter-op thread: graph collectives must still not deadlock.
    "2ranks_one_interop_thread": ([2], False, {"TF_NUM_INTEROP_THREADS": "1"}),
    "4ranks": ([4], False, {}),
    "2x2_virtual_nodes": ([2, 2], True, {"AIAK_TEST_LAYOUT": "2,2"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tf_per_rank_suite(layout):
    nodes, virtual, env = LAYOUTS[layout]
    proc = run_ranks(nodes, PER_RANK, env={**FRONTEND, **env}, virtual_hosts=virtual)
    assert proc.returncode == 0, proc.stdout[-6000:]
    # tests/parallel/test_tf_ops.py: one rank skips the two tests that need two.
    check_rank_summaries(proc.stdout, sum(nodes), 22 if sum(nodes) > 1 else 20)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env=env_with({"TF_CPP_MIN_LOG_LEVEL": "2"}), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)


def test_tensorflow_frontend_never_loads_torch_and_refuses_calls_before_init():
    proc = _python("""
        import sys
        import tensorflow as tf
        import aiak_training.tensorflow as hvd
        assert "torch" not in sys.modules, "aiak_training.tensorflow imported torch"
        for call in (lambda: hvd.allreduce(tf.ones([2])),
                     lambda: tf.function(lambda: hvd.allgather(tf.ones([2])))(),
                     lambda: hvd.broadcast_variables([tf.Variable(1.0)], 0),
                     hvd.rank, hvd.join):
            try:
                call()
            except ValueError as e:
                assert "Horovod has not been initialized; use hvd.init()." in str(e), e
            else:
                raise AssertionError("no error before init")
        print("tensorflow frontend ok")
        """)
    assert proc.returncode == 0 and "tensorflow frontend ok" in proc.stdout, proc.stdout[-3000:]


def test_torch_frontend_never_loads_tensorflow():
    proc = _python("""
        import sys
        import aiak_training.torch
        assert "tensorflow" not in sys.modules and "keras" not in sys.modules
        print("torch frontend ok")
        """)
    assert proc.returncode == 0 and "torch frontend ok" in proc.stdout, proc.stdout[-3000:]
