"""aiak_training.ray on a real local Ray cluster of two simulated nodes (no mocks).

One cluster (``ray.cluster_utils.Cluster``: a head and a second node, 3 CPUs each) and one
4-worker executor (2 nodes x 2 workers) serve the whole module, because Ray start-up is slow
on small machines.  Skipped when the ``ray`` extra is not installed.
"""
import os
import signal
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed "
                                        "(pip install -e '.[ray]')")
import cloudpickle  # noqa: E402
import psutil  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from aiak_training.ray import RayExecutor, RayWorkerError  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL = os.path.join(REPO, "tests", "parallel")
sys.path.insert(0, os.path.join(REPO, "examples"))
import digits_train  # noqa: E402
from launch import JOBS, aiakrun_digits_result  # noqa: E402
sys.path.insert(0, JOBS)
import elastic_exact  # noqa: E402
from elastic_support import check_epochs  # noqa: E402

# The actors cannot import this file or examples/: ship their code by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(digits_train)
cloudpickle.register_pickle_by_value(elastic_exact)

# The op/dtype matrix of tests/parallel/test_torch_ops.py that runs on the Ray workers.
OPS_SELECTION = ("rank_and_size or local_and_cross or every_dtype_and_op or prescale_postscale "
                 "or grouped_allreduce or allgather_variable or broadcast_from_every_root "
                 "or alltoall or reducescatter_uneven")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=3, include_dashboard=False))
    c.add_node(num_cpus=3)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module", params=["mpi", "gloo"])
def executor(cluster, request):
    """The 4-worker executor, once per transport: the actors as one MPI world (hydra started
    by hand, the default where MPICH is installed) and as Gloo worlds."""
    settings = RayExecutor.create_settings(timeout_s=30)
    ex = RayExecutor(settings, num_workers=4, num_hosts=2)
    os.environ["AIAK_RAY_TRANSPORT"] = request.param
    try:
        ex.start(extra_env_vars={"AIAK_TEST_LAYOUT": "2,2"})
    finally:
        del os.environ["AIAK_RAY_TRANSPORT"]
    assert ex.transport == request.param
    yield ex
    ex.shutdown()


# ---- the elastic form ---------------------------------------------------------------------
# These run before the module's fixed-size executor exists, on the module's cluster with
# cpus_per_worker=3: one slot per node.  They replace the second node, so the later tests
# still find two nodes of 3 CPUs.
ELASTIC_ENV = {"EPOCHS": "5", "STEP_SLEEP": "0.1", "COMMIT_EVERY": "2",
               "HOROVOD_GLOO_TIMEOUT_SECONDS": "20"}


def _elastic_exact(env):
    os.environ.update(env)
    return elastic_exact.main()


def _progress(path):
    try:
        with open(path) as f:
            steps, size = f.read().split()
        return int(steps), int(size)
    except (OSError, ValueError):
        return 0, 0


def _wait_progress(path, done, what, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done(*_progress(path)):
            return _progress(path)
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s (progress {_progress(path)})")


def test_elastic_job_survives_a_lost_node_and_grows_onto_a_new_one(cluster, tmp_path):
    progress = str(tmp_path / "progress")
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=1, max_workers=2,
                     cpus_per_worker=3, elastic_timeout=30)
    ex.start()
    outcome = {}

    def run():
        try:
            outcome["results"] = ex.run(_elastic_exact, args=[dict(ELASTIC_ENV,
                                                                   PROGRESS=progress)])
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        _wait_progress(progress, lambda steps, size: steps >= 4 and size == 2,
                       "4 committed steps on 2 nodes")
        cluster.remove_node(next(iter(cluster.worker_nodes)))
        lost_at = _progress(progress)[0]
        _wait_progress(progress, lambda steps, size: size == 1 and steps > lost_at + 2,
                       "progress on the surviving node")
        cluster.add_node(num_cpus=3)
        _wait_progress(progress, lambda steps, size: size == 2, "growth onto the new node")
        runner.join(timeout=90)
        assert not runner.is_alive(), "the elastic run did not finish"
    finally:
        ex.shutdown()
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    history = results[0]["history"]
    sizes = [h[1] for h in history]
    # 2 ranks, then the survivor alone, then 2 again: no committed step was lost.
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2
    check_epochs(history, elastic_exact.N_SAMPLES, int(ELASTIC_ENV["EPOCHS"]))
    assert results[0]["params"] == results[1]["params"] == elastic_exact.replay(history)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2


def test_elastic_job_with_fewer_than_min_workers_fails_in_elastic_timeout(cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=3,
                     cpus_per_worker=3, elastic_timeout=3)
    ex.start()
    start = time.monotonic()
    try:
        with pytest.raises(RayWorkerError,
                           match=r"elastic job failed: only 2 slot\(s\) usable, fewer than "
                                 r"the min_workers of 3, for 3 s \(elastic_timeout\)"):
            ex.run(_elastic_exact, args=[ELASTIC_ENV])
    finally:
        ex.shutdown()
    assert time.monotonic() - start < 30


def _layout():
    import ray as ray_
    import aiak_training.torch as hvd
    hvd.init()
    out = dict(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
               local_size=hvd.local_size(), cross_rank=hvd.cross_rank(),
               cross_size=hvd.cross_size(), gloo=hvd.gloo_enabled(), mpi=hvd.mpi_enabled(),
               node=ray_.get_runtime_context().get_node_id(), pid=os.getpid())
    hvd.shutdown()
    return out


def test_topology_is_two_nodes_of_two_local_ranks(executor, cluster):
    layout = executor.run(_layout)
    assert [r["rank"] for r in layout] == [0, 1, 2, 3]
    gloo = executor.transport == "gloo"
    assert all(r["size"] == 4 and r["gloo"] == gloo and r["mpi"] != gloo for r in layout)
    # The function ran in the actors themselves (it read the node id from Ray's context).
    assert [r["pid"] for r in layout] == executor.run(os.getpid)
    nodes = [r["node"] for r in layout]
    # Ranks 0,1 share one node and 2,3 the other: taken from where Ray put the actors.
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert set(nodes) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert [(r["local_rank"], r["local_size"]) for r in layout] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [(r["cross_rank"], r["cross_size"]) for r in layout] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def _run_ops_tests(selection):
    import contextlib
    import io
    import pytest as pytest_

    class Outcomes:
        def __init__(self):
            self.counts = {}

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1

    outcomes, out = Outcomes(), io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pytest_.main(["-q", "-p", "no:cacheprovider", "--rootdir", PARALLEL,
                             os.path.join(PARALLEL, "test_torch_ops.py"), "-k", selection],
                            plugins=[outcomes])
    text = out.getvalue()
    return int(code), outcomes.counts, text[text.find("= FAILURES ="):][:6000]


def test_op_dtype_matrix_exact_on_ray_workers(executor):
    """tests/parallel/test_torch_ops.py's exact checks (every dtype and op of allreduce,
    allgather, broadcast, alltoall, reducescatter, plus the 2x2 topology) on the 4 actors."""
    results = executor.run(_run_ops_tests, args=[OPS_SELECTION])
    for rank, (code, counts, failures) in enumerate(results):
        assert code == 0 and set(counts) == {"passed"}, f"rank {rank}: {counts}\n{failures}"
    # Every rank ran the same tests; the matrix is large (>100 parametrized cases).
    assert len({tuple(sorted(c.items())) for _, c, _ in results}) == 1
    assert results[0][1]["passed"] > 100


def test_worker_exception_reaches_driver_with_rank_and_traceback(executor):
    def fails_on_rank_2(value):
        if os.environ["HOROVOD_RANK"] == "2":
            raise ValueError(f"bad value {value}")
        return value

    with pytest.raises(ValueError) as info:
        executor.run(fails_on_rank_2, args=[7])
    text = str(info.value)
    assert "bad value 7" in text and "raised on rank 2" in text
    assert "fails_on_rank_2" in text  # the worker's traceback
    # The executor still works afterwards.
    assert executor.run(lambda: int(os.environ["HOROVOD_RANK"])) == [0, 1, 2, 3]
    assert executor.execute_single(lambda _executable: os.environ["HOROVOD_RANK"]) == "0"


def test_unpicklable_function_is_named_before_any_worker_runs(executor, cluster):
    lock = threading.Lock()

    def holds_a_lock():
        return lock.locked()

    with pytest.raises(TypeError, match="function 'test_unpicklable.*holds_a_lock' cannot be "
                                        "pickled.*lock"):
        executor.run(holds_a_lock)
    # start(): the check comes before the placement group or any actor exists.
    fresh = RayExecutor(RayExecutor.create_settings(timeout_s=10), num_workers=1)
    groups_before = len(ray.util.placement_group_table())
    with pytest.raises(TypeError, match="executable_kwargs.*cannot be pickled"):
        fresh.start(executable_cls=dict, executable_kwargs={"lock": lock})
    assert fresh.workers == []
    assert len(ray.util.placement_group_table()) == groups_before  # nothing was placed


def test_more_workers_than_the_cluster_has(cluster):
    settings = RayExecutor.create_settings(timeout_s=10, placement_group_timeout_s=2)
    with pytest.raises(TimeoutError, match=r"3 distinct node\(s\).*within "
                                           r"placement_group_timeout_s=2 s.*2 alive node\(s\)"):
        RayExecutor(settings, num_hosts=3).start()
    with pytest.raises(TimeoutError, match=r"room for 9 worker\(s\).*CPU=6"):
        RayExecutor(settings, num_workers=9).start()


def test_elastic_argument_checks():
    settings = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(settings, max_workers=4)
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers`"):
        RayExecutor(settings, min_workers=1, num_workers=2)
    with pytest.raises(ValueError, match="num_workers must be num_hosts x"):
        RayExecutor(settings, num_workers=3, num_hosts=2)
    with pytest.raises(ValueError, match=r"max_workers=1\): must be an integer >= min_workers"):
        RayExecutor(settings, min_workers=2, max_workers=1)
    with pytest.raises(ValueError, match=r"cooldown_range=\[5, 1\]"):
        RayExecutor(settings, min_workers=1, cooldown_range=[5, 1])
    with pytest.raises(ValueError, match="reset_limit=-1"):
        RayExecutor(settings, min_workers=1, reset_limit=-1)
    ex = RayExecutor(settings, min_workers=1, max_workers=2)
    with pytest.raises(RuntimeError, match="call start"):
        ex.run(os.getpid)
    with pytest.raises(NotImplementedError, match="elastic form"):
        ex.run_remote(os.getpid)


def _kill_rank_1_mid_collective():
    import torch
    import aiak_training.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(4), name="warmup")
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(100):  # rank 0 is blocked in here when rank 1 dies
        hvd.allreduce(torch.ones(4), name=f"step{step}")
    return "not reached"


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_killed_actor_is_an_error_naming_the_rank_and_shutdown_cleans_up(cluster, transport,
                                                                          monkeypatch):
    monkeypatch.setenv("AIAK_RAY_TRANSPORT", transport)
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=10), num_workers=2)
    ex.start()
    assert ex.transport == transport
    try:
        pids = ex.run(os.getpid)
        start = time.monotonic()
        with pytest.raises(RayWorkerError, match=r"rank 1 \(host .*\) died during run") as info:
            ex.run(_kill_rank_1_mid_collective)
        assert info.value.rank == 1
        assert time.monotonic() - start < 10  # within the collective timeout
    finally:
        ex.shutdown()
    assert ex.workers == []
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) for p in pids), "a worker process outlived shutdown()"


def test_digits_training_reaches_the_aiakrun_accuracy(cluster):
    epochs = 3
    correct, total = aiakrun_digits_result(epochs)
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    ex.start()
    try:
        results = ex.run(digits_train.train, kwargs=dict(epochs=epochs, verbose=False))
    finally:
        ex.shutdown()
    # The default transport where MPICH is installed: the actors form an MPI world.
    assert ex.transport == "mpi"
    assert [r["rank"] for r in results] == [0, 1] and not any(r["gloo"] for r in results)
    # Same seeds, shards and steps; a 2-rank sum is order-free: the same model, exactly.
    assert [(r["correct"], r["total"]) for r in results] == [(correct, total)] * 2
    assert correct / total > 0.8


def test_transport_choice_and_its_errors(monkeypatch, tmp_path):
    from aiak_training.ray.mpi_world import ray_transport
    assert ray_transport({"AIAK_RAY_TRANSPORT": "gloo"}) == ("gloo", None)
    transport, mpiexec = ray_transport({"PATH": os.environ["PATH"]})
    assert transport == "mpi" and os.path.basename(mpiexec) in ("mpirun", "mpiexec")
    with pytest.raises(ValueError, match=r"AIAK_RAY_TRANSPORT='nccl': expected auto, mpi or gloo"):
        ray_transport({"AIAK_RAY_TRANSPORT": "nccl"})
    # A launcher that is not MPICH's hydra: auto falls back to Gloo, mpi says why it cannot.
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 5.0.3'\n")
    fake.chmod(0o755)
    env = {"AIAK_MPIRUN": str(fake), "PATH": os.environ["PATH"]}
    assert ray_transport(env) == ("gloo", None)
    with pytest.raises(RuntimeError, match=r"AIAK_RAY_TRANSPORT=mpi, but the Ray workers cannot "
                                           r"form an MPI world: .* is openmpi"):
        ray_transport({**env, "AIAK_RAY_TRANSPORT": "mpi"})
