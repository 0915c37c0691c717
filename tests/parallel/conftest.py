"""Per-rank test setup: these files run under mpiexec/aiakrun, one pytest per rank."""
import os
import sys

import pytest

# benchmarks/jobs holds the per-rank code these tests share with the benchmarks (the GPU
# stand-ins, the digits training).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks", "jobs"))

# Set before hvd.init(), as Horovod's own tests do.
os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")
os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")


@pytest.fixture(scope="session", autouse=True)
def hvd_session():
    # The TensorFlow suite runs with AIAK_TEST_FRONTEND=tensorflow, so that its processes
    # never load torch.
    if os.environ.get("AIAK_TEST_FRONTEND") == "tensorflow":
        import aiak_training.tensorflow as hvd
    else:
        import aiak_training.torch as hvd
    hvd.init()
    yield hvd
    # As Horovod's tearDown: no rank shuts down (which stops every rank's engine) while
    # another is still running tests.
    hvd.barrier()
    hvd.shutdown()
