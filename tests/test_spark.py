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
from launch import JOBS, aiakrun_digits_result  # noqa: E402
sys.path.insert(0, JOBS)
import elastic_exact  # noqa: E402
from elastic_support import check_epochs  # noqa: E402

# The Spark tasks cannot import this file or examples/: ship their code by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(digits_train)
cloudpickle.register_pickle_by_value(elastic_exact)


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
            if "aiak_training.runner.modes.scheduler_child" in " ".join(p.info["cmdline"] or [])]


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
    with pytest.raises(ValueError, match=r"min_np <= num_proc <= max_np, got 3, 2, 2"):
        aiak_spark.run_elastic(_allreduce_rank, num_proc=2, min_np=3)
    with pytest.raises(ValueError, match=r"reset_limit=-1\): must be an integer >= 0"):
        aiak_spark.run_elastic(_allreduce_rank, num_proc=2, reset_limit=-1)
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


# ---- run_elastic ---------------------------------------------------------------------------
ELASTIC_ENV = {"EPOCHS": "2", "STEP_SLEEP": "0.05", "COMMIT_EVERY": "2",
               "HOROVOD_GLOO_TIMEOUT_SECONDS": "20"}


def _elastic_exact(env):
    os.environ.update(env)
    return elastic_exact.main()


def _elastic_workers():
    """{worker id: pid} of the elastic rank processes now running."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        if "aiak_training.runner.modes.scheduler_child" not in " ".join(p.info["cmdline"] or []):
            continue
        try:
            wid = p.environ().get("AIAK_ELASTIC_WORKER_ID")
        except psutil.Error:
            continue
        if wid:
            found[wid] = p.pid
    return found


def test_run_elastic_returns_exact_per_rank_results(spark):
    results = aiak_spark.run_elastic(_elastic_exact, args=(ELASTIC_ENV,), num_proc=2,
                                     stdout=io.StringIO(), stderr=io.StringIO())
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    history = results[0]["history"]
    check_epochs(history, elastic_exact.N_SAMPLES, int(ELASTIC_ENV["EPOCHS"]))
    assert results[0]["params"] == results[1]["params"] == elastic_exact.replay(history)
    assert _elastic_workers() == {}


def test_run_elastic_continues_on_the_survivors_of_a_killed_rank(spark, tmp_path):
    progress = str(tmp_path / "progress")
    env = dict(ELASTIC_ENV, PROGRESS=progress, STEP_SLEEP="0.15")
    log = io.StringIO()
    outcome = {}

    def run():
        try:
            outcome["results"] = aiak_spark.run_elastic(
                _elastic_exact, args=(env,), num_proc=3, min_np=2, elastic_timeout=60,
                stdout=io.StringIO(), stderr=log)
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(progress) as f:
                if int(f.read().split()[0]) >= 4:
                    break
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(0.05)
    else:
        raise AssertionError(f"no 4 committed steps in 60 s:\n{log.getvalue()[-3000:]}")
    victim = _elastic_workers()["w2"]
    os.kill(victim, 9)
    runner.join(timeout=90)
    assert not runner.is_alive(), log.getvalue()[-3000:]
    assert "error" not in outcome, f"{outcome.get('error')}\n{log.getvalue()[-3000:]}"
    results = outcome["results"]
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    history = results[0]["history"]
    assert history[0][1] == 3 and history[-1][1] == 2
    check_epochs(history, elastic_exact.N_SAMPLES, int(env["EPOCHS"]))
    assert results[0]["params"] == results[1]["params"] == elastic_exact.replay(history)
    assert "exited with signal SIGKILL" in log.getvalue()
    assert _elastic_workers() == {}


def test_run_elastic_fails_at_once_when_local_spark_loses_a_task(spark, tmp_path):
    """local[4] retries no task: a lost task's Python worker fails the Spark job, and with no
    task left the elastic job must fail now, not after elastic_timeout."""
    progress = str(tmp_path / "progress")
    env = dict(ELASTIC_ENV, PROGRESS=progress, STEP_SLEEP="0.15")
    outcome = {}

    def run():
        try:
            aiak_spark.run_elastic(_elastic_exact, args=(env,), num_proc=2, min_np=1,
                                   elastic_timeout=120, stdout=io.StringIO(),
                                   stderr=io.StringIO())
        except BaseException as exc:  # checked below
            outcome["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(progress) and time.monotonic() < deadline:
        time.sleep(0.05)
    task_worker = psutil.Process(_elastic_workers()["w1"]).ppid()  # the Spark Python worker
    killed = time.monotonic()
    os.kill(task_worker, 9)
    runner.join(timeout=60)
    assert not runner.is_alive()
    assert time.monotonic() - killed < 30  # far less than elastic_timeout=120
    assert isinstance(outcome.get("error"), aiak_spark.ElasticJobError)
    assert "the Spark job ended" in str(outcome["error"])
    assert "no Spark task is left" in str(outcome["error"])
    deadline = time.monotonic() + 15
    while _elastic_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _elastic_workers() == {}
