"""The Gloo transport and ``aiakrun --gloo``: the per-rank op/dtype suite over Gloo, a killed
rank, re-forming worlds in one process, and the transport's bad-input errors."""
import re
import subprocess
import sys
import time

import pytest

from launch import REPO, check_rank_summaries, env_with

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)

PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
          "--rootdir", "tests/parallel"]


def aiakrun_gloo(args, env=None, timeout=300):
    cmd = [sys.executable, "-m", "aiak_training.runner.launch", "--gloo", *args]
    return subprocess.run(cmd, env=env_with(env), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


# ---- the op/dtype matrix over Gloo ------------------------------------------------------------
#: 4 ranks run the op/dtype matrix and the layout tests of the suite, to stay lean.
FOUR_RANK_SELECTION = ("every_dtype or uneven or every_root or variable_first or with_splits or "
                       "topology or launcher or mismatch or process_sets")
#: Tests each rank passes: the whole suite at 2 or more ranks, and the 4-rank selection.
WHOLE_SUITE_PASSES, FOUR_RANK_PASSES = 159, 116

@pytest.mark.parametrize("layout", ["2ranks", "2ranks_tiny_fusion_and_cache",
                                    "2x2_virtual_nodes"])
def test_torch_ops_suite_over_gloo(layout):
    """tests/parallel/test_torch_ops.py (exact results for every op, dtype, mismatch error,
    process set, join, timeline) on 2 ranks, on 2 ranks with a tiny fusion buffer and response
    cache (eviction, renegotiation, fused and in-place tensors in one response), and on 4
    ranks laid out as 2 virtual nodes."""
    if layout == "2ranks":
        args, env, n = ["-np", "2"], {}, 2
    elif layout == "2ranks_tiny_fusion_and_cache":
        args, n = ["-np", "2"], 2
        env = {"HOROVOD_FUSION_THRESHOLD": "4096", "HOROVOD_CACHE_CAPACITY": "3",
               "AIAK_ZERO_COPY_BYTES": "256"}
    else:
        args, env, n = ["-np", "4", "-H", "node0:2,node1:2", "--virtual-hosts"], \
            {"AIAK_TEST_LAYOUT": "2,2"}, 4
    select = [] if n == 2 else ["-k", FOUR_RANK_SELECTION]
    proc = aiakrun_gloo(args + PYTEST + ["tests/parallel/test_torch_ops.py"] + select, env)
    _check_suite(proc, n, WHOLE_SUITE_PASSES if n == 2 else FOUR_RANK_PASSES)


def _check_suite(proc, n, minimum):
    """Every one of ``n`` ranks passed the same tests, at least ``minimum``, through Gloo
    alone."""
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, n, minimum)
    # aiakrun --gloo labels every line with its rank, as mpiexec -l does.
    for rank in range(n):
        assert re.search(rf"^\[{rank}\] .*\d+ passed", proc.stdout, re.M), proc.stdout[-3000:]
    assert "mpiexec" not in proc.stdout and "hydra" not in proc.stdout


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 1, 1)], ids=["3x1", "2+1+1"])
def test_torch_ops_suite_over_gloo_on_emulated_cluster(layout):
    """The same suite with ranks on 3 emulated nodes (network namespaces, 1 Gbit/s links; root
    only): every cross-node byte goes over TCP between namespaces, started through the
    cluster's launch agent.  3x1: the whole suite; 2+1+1 (uneven nodes): the op/dtype matrix
    and layout selection."""
    from elastic_support import cluster_run, emulated_cluster
    with emulated_cluster(3) as cluster:
        hosts = ",".join(f"{h}:{n}" for h, n in zip(cluster.hosts, layout))
        whole = layout == (1, 1, 1)
        select = [] if whole else ["-k", FOUR_RANK_SELECTION]
        proc = cluster_run(cluster, [sys.executable, "-m", "aiak_training.runner.launch",
                                     "--gloo", "-np", str(sum(layout)), "-H", hosts, *PYTEST,
                                     "tests/parallel/test_torch_ops.py", *select],
                           {"AIAK_TEST_LAYOUT": ",".join(map(str, layout))}, timeout=300,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _check_suite(proc, sum(layout), WHOLE_SUITE_PASSES if whole else FOUR_RANK_PASSES)


# ---- failures -----------------------------------------------------------------------------
def test_killed_rank_fails_the_others_and_is_reported():
    start = time.monotonic()
    proc = aiakrun_gloo(["-np", "3", sys.executable, "tests/scripts/kill_rank.py"],
                        {"HOROVOD_GLOO_TIMEOUT_SECONDS": "20"}, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 128 + 9, proc.stdout[-3000:]  # rank 1's SIGKILL, as with MPI
    assert elapsed < 60, elapsed
    for survivor in (0, 2):
        assert f"rank {survivor} got HorovodInternalError" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"^aiakrun: job failed: rank 1 \(host localhost\) exited with signal "
                     r"SIGKILL", proc.stdout, re.M), proc.stdout[-3000:]
    assert "UNEXPECTED" not in proc.stdout


def test_rank_lost_with_its_wrapper_names_the_host():
    """A rank whose task wrapper is killed too (its host went away) cannot report; the Gloo
    launcher records it as lost, naming the host and its ranks."""
    script = ("import os, signal, time, torch, aiak_training.torch as hvd\n"
              "hvd.init()\n"
              "hvd.allreduce(torch.ones(4))\n"
              "if hvd.rank() == 1:\n"
              "    os.kill(os.getppid(), signal.SIGKILL)  # the task wrapper first\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n"
              "try:\n"
              "    for i in range(1000):\n"
              "        hvd.allreduce(torch.ones(4), name='x')\n"
              "        time.sleep(0.01)\n"
              "except hvd.HorovodInternalError:\n"
              "    print('survivor', hvd.rank(), 'got HorovodInternalError', flush=True)\n"
              "    raise SystemExit(1)\n")
    proc = aiakrun_gloo(["-np", "2", "-H", "node0:1,node1:1", "--virtual-hosts",
                         sys.executable, "-c", script], timeout=120)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "survivor 0 got HorovodInternalError" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"^aiakrun: job failed: rank 1 \(host node1\) was lost: host node1 "
                     r"\(rank 1\)", proc.stdout, re.M), proc.stdout[-3000:]


# ---- re-forming worlds in one process ---------------------------------------------------------
def test_shutdown_init_reforms_worlds_of_other_sizes():
    proc = subprocess.run([sys.executable, "tests/scripts/gloo_reform.py", "driver", "3"],
                          env=env_with(), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in range(3):
        assert f"worker {rank} ok" in proc.stdout, proc.stdout[-4000:]
    assert "transport Gloo" in proc.stdout, proc.stdout[-4000:]
    assert "terminate called" not in proc.stdout


# ---- bad input --------------------------------------------------------------------------------
def _run(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env_with(env), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)


def test_missing_identity_is_a_clear_error():
    proc = _run("import aiak_training.torch as hvd\n"
                "try:\n    hvd.init()\nexcept ValueError as e:\n    print('ERR', e)\n",
                {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                 "HOROVOD_GLOO_RENDEZVOUS_PORT": "1"})
    assert "ERR Gloo mode needs HOROVOD_RANK" in proc.stdout, proc.stdout


def test_unreachable_store_fails_within_the_gloo_timeout():
    start = time.monotonic()
    proc = _run("import aiak_training.torch as hvd\n"
                "try:\n    hvd.init()\nexcept ValueError as e:\n    print('ERR', e)\n",
                {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2",
                 "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                 "HOROVOD_GLOO_RENDEZVOUS_PORT": "9", "HOROVOD_GLOO_TIMEOUT_SECONDS": "2"})
    assert time.monotonic() - start < 60
    assert "cannot reach the store at 127.0.0.1:9 within 2 s" in proc.stdout, proc.stdout


def test_selection_and_world_from_env():
    from aiak_training.runtime.transport import gloo
    assert gloo.gloo_selected({"HOROVOD_CONTROLLER": "gloo"})
    assert gloo.gloo_selected({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"})
    assert not gloo.gloo_selected({"HOROVOD_CONTROLLER": "mpi",
                                   "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"})
    assert not gloo.gloo_selected({})
    with pytest.raises(ValueError, match="HOROVOD_CONTROLLER='tcp'"):
        gloo.gloo_selected({"HOROVOD_CONTROLLER": "tcp"})
    info = gloo.world_from_env({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4",
                                "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
                                "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
                                "HOROVOD_HOSTNAME": "b", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "h",
                                "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234",
                                "AIAK_GLOO_STORE_PREFIX": "w7"})
    assert info == gloo.WorldInfo(3, 4, 1, 2, 1, 2, "b", "h", 1234, "w7")
    with pytest.raises(ValueError, match="HOROVOD_SIZE='x'"):
        gloo.world_from_env({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "x"})
    with pytest.raises(ValueError, match="rank 4 is outside 0..3"):
        gloo.WorldInfo(4, 4, 0, 1, 0, 1, "a", "h", 1).validate()


def test_rank_identities_follow_horovod():
    from aiak_training.runner.cli.hosts import HostSlots, assign_slots
    ids = [r.horovod_env() for r in assign_slots([HostSlots("a", 2), HostSlots("b", 1)], 3)]
    assert [(i["HOROVOD_RANK"], i["HOROVOD_LOCAL_RANK"], i["HOROVOD_LOCAL_SIZE"],
             i["HOROVOD_CROSS_RANK"], i["HOROVOD_CROSS_SIZE"], i["HOROVOD_HOSTNAME"])
            for i in ids] == [("0", "0", "2", "0", "2", "a"), ("1", "1", "2", "0", "1", "a"),
                              ("2", "0", "1", "1", "2", "b")]
    assert {i["HOROVOD_SIZE"] for i in ids} == {"3"}
