"""aiak_training.spark.run in a real Spark ``local[4]`` session (no mocks).

One SparkSession serves the whole module (JVM start-up is slow).  Skipped when the ``spark``
extra is not installed.
"""
import io
import os
import sys
import threading
import time

import pytest

pyspark = pytest.importorskip("pyspark", reason="the spark extra is not installed "
                                                "(pip install -e '.[spark]')")
import cloudpickle  # noqa: E402
import psutil  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

import aiak_training.spark as aiak_spark  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
import digits_train  # noqa: E402
from launch import aiakrun_digits_result  # noqa: E402

# The Spark tasks cannot import this file or examples/: ship their code by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(digits_train)


@pytest.fixture(scope="module")
def spark():
    session = (SparkSession.builder.master("local[4]").appName("aiak-training tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def _ranks_alive():
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "aiak_training.runner.engine_child" in " ".join(p.info["cmdline"] or [])]


def _allreduce_rank(scale, offset=0):
    import torch
    import aiak_training.torch as hvd
    hvd.init()
    print(f"hello from rank {hvd.rank()}")
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1) * scale]), op=hvd.Sum)
    return dict(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                local_size=hvd.local_size(), cross_size=hvd.cross_size(),
                total=float(total), offset=offset, gloo=hvd.gloo_enabled(),
                env_rank=os.environ["HOROVOD_RANK"], extra=os.environ.get("AIAK_TEST_EXTRA"))


def test_run_returns_per_rank_results_in_rank_order(spark):
    out = io.StringIO()
    results = aiak_spark.run(_allreduce_rank, args=(10,), kwargs={"offset": 3}, num_proc=2,
                             env={"AIAK_TEST_EXTRA": "yes"}, stdout=out)
    # 10 * (1 + 2), computed over Gloo between the two tasks.
    assert results == [dict(rank=r, size=2, local_rank=r, local_size=2, cross_size=1,
                            total=30.0, offset=3, gloo=True, env_rank=str(r), extra="yes")
                       for r in range(2)]
    lines = out.getvalue().splitlines()
    assert "[0]<stdout>:hello from rank 0" in lines and "[1]<stdout>:hello from rank 1" in lines
    # num_proc defaults to the context's parallelism (local[4]).
    assert aiak_spark.run(_env_rank, stdout=out) == [0, 1, 2, 3]


def _env_rank():
    return int(os.environ["HOROVOD_RANK"])


def _fails_on_rank_1():
    import time as time_
    if os.environ["HOROVOD_RANK"] == "1":
        raise ValueError("rank one is broken")
    time_.sleep(120)  # rank 0 would run on; the failure must stop it


def test_raising_task_fails_the_run_naming_the_rank(spark):
    start = time.monotonic()
    with pytest.raises(aiak_spark.SparkRankError,
                       match=r"rank 1 \(host .*, partition 1\) raised ValueError") as info:
        aiak_spark.run(_fails_on_rank_1, num_proc=2, stdout=io.StringIO())
    assert info.value.rank == 1
    assert "rank one is broken" in info.value.remote_traceback
    assert "_fails_on_rank_1" in info.value.remote_traceback
    assert time.monotonic() - start < 60  # rank 0's 120 s sleep was cut short
    deadline = time.monotonic() + 15
    while _ranks_alive() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _ranks_alive() == [], "a rank process outlived the failed run"


def test_bad_input(spark):
    with pytest.raises(ValueError, match="Gloo only"):
        aiak_spark.run(_allreduce_rank, args=(1,), num_proc=2, use_mpi=True)
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot be pickled.*lock"):
        aiak_spark.run(lambda: lock.locked(), num_proc=2)
    with pytest.raises(TimeoutError, match=r"0 of num_proc=8 rank\(s\) started within "
                                           r"start_timeout=3 s.*defaultParallelism.* is 4"):
        aiak_spark.run(_allreduce_rank, args=(1,), num_proc=8, start_timeout=3)
    with pytest.raises(NotImplementedError, match="elastic"):
        aiak_spark.run_elastic(_allreduce_rank)
    # The session is still usable afterwards.
    assert aiak_spark.run(_env_rank, num_proc=2, stdout=io.StringIO()) == [0, 1]


def test_digits_training_reaches_the_aiakrun_accuracy(spark):
    epochs = 3
    correct, total = aiakrun_digits_result(epochs)
    results = aiak_spark.run(digits_train.train, kwargs=dict(epochs=epochs, verbose=False),
                             num_proc=2)
    assert [r["rank"] for r in results] == [0, 1] and all(r["gloo"] for r in results)
    assert [(r["correct"], r["total"]) for r in results] == [(correct, total)] * 2
    assert correct / total > 0.8
