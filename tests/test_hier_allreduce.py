"""Hierarchical allreduce (issue 4): exactness on several node layouts, selection rules, the
selection log line, and one end-to-end run on an emulated 2x2 cluster.

The per-rank suite is tests/parallel/test_allreduce_algos.py.  Layouts use virtual nodes
(HOROVOD_HOSTNAME per rank, no namespaces), so they run anywhere MPI runs; the emulated
cluster test needs root and network namespaces and is skipped, with the reason, elsewhere.
Ranks are oversubscribed on small CI machines, so sizes stay moderate and multi-chunk paths
come from a tiny AIAK_HIER_CHUNK_BYTES rather than from big buffers.
"""
import re
import sys
from types import SimpleNamespace

import pytest

from aiak_training.allreduce import resolve_algorithm
from aiak_training.common.config import Config
from launch import REPO, check_rank_summaries, env_with, run_ranks

SUITE = "tests/parallel/test_allreduce_algos.py"
# -s: the engine's INFO log line (written to stderr at init) must reach the output.
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-s", "-p", "no:cacheprovider",
          "--rootdir", "tests/parallel"]
COMMON_ENV = {"AIAK_HIER_CHUNK_BYTES": "1024", "HOROVOD_LOG_LEVEL": "INFO"}
# Layouts where the engine runs flat: skip the engine's dtype matrix (flat is covered by
# test_multiprocess.py) and the hier_pipelined tuning variants, keep every direct algorithm test.
QUICK = ["-k", "not engine_allreduce_every_dtype and not tuning_options"]

# Tests each rank passes: the suite (one test skips on virtual nodes), QUICK's selection.
PASSES, PASSES_QUICK = 57, 43

# name: (ranks per node, environment, expected engine algorithm, extra pytest args, passes)
LAYOUTS = {
    "2x2": ([2, 2], {"AIAK_ALLREDUCE_ALGO": "hierarchical"}, "hier_pipelined", [], PASSES),
    "2x3": ([3, 3], {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, "hier_pipelined", [], PASSES),
    "2+1": ([2, 1], {}, "hier_pipelined", [], PASSES),  # auto, unequal ranks per node
    "3x1": ([1, 1, 1], {"AIAK_ALLREDUCE_ALGO": "hierarchical"}, "flat", QUICK, PASSES_QUICK),
    "1x3": ([3], {"AIAK_ALLREDUCE_ALGO": "hier_staged"}, "flat", QUICK, PASSES_QUICK),
}


def check_suite_output(out: str, nranks: int, expect_algo: str, minimum: int) -> None:
    check_rank_summaries(out, nranks, minimum)
    # Logged once (rank 0 only, global set only) at INFO.
    lines = re.findall(r"allreduce algorithm: (\S+)", out)
    assert lines == [expect_algo], lines


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout(layout):
    nodes, env, expect, extra, minimum = LAYOUTS[layout]
    env = dict(COMMON_ENV, **env, AIAK_TEST_LAYOUT=",".join(map(str, nodes)),
               AIAK_TEST_EXPECT_ALGO=expect)
    proc = run_ranks(nodes, PYTEST + extra + [SUITE], env=env, virtual_hosts=True,
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_suite_output(proc.stdout, sum(nodes), expect, minimum)


# ---- selection rules (no MPI needed) -------------------------------------------------------
def fake_topology(node_sizes):
    return SimpleNamespace(node_sizes=node_sizes, num_nodes=len(node_sizes),
                           size=sum(node_sizes))


@pytest.mark.parametrize("algo, hier_flag, nodes, is_global, expected", [
    ("auto", None, [2, 2], True, "hier_pipelined"),         # unset: chosen by topology
    ("auto", None, [3, 3, 3], True, "hier_pipelined"),
    ("auto", None, [2, 1], True, "hier_pipelined"),        # more than one rank on some node
    ("auto", None, [1, 1, 1], True, "flat"),          # one rank per node
    ("auto", None, [4], True, "flat"),                # single node
    ("auto", True, [2, 2], True, "hier_pipelined"),         # HOROVOD_HIERARCHICAL_ALLREDUCE=1
    ("auto", True, [4], True, "flat"),                 # ignored on one node, as in Horovod
    ("flat", True, [2, 2], True, "flat"),              # explicit AIAK_ALLREDUCE_ALGO wins
    ("hierarchical", False, [2, 2], True, "hier_pipelined"),
    ("hierarchical", False, [1, 1], True, "flat"),
    ("hierarchical", False, [3], True, "flat"),
    ("hier_staged", False, [3, 3], True, "hier_staged"),
    ("hier_staged", False, [3], True, "flat"),
    ("hier_pipelined", False, [2, 3], True, "hier_pipelined"),
    ("hier_pipelined", False, [2, 2], False, "flat"),       # non-global process sets
    ("auto", True, [2, 2], False, "flat"),
    ("auto", False, [2, 2], True, "flat"),              # HOROVOD_HIERARCHICAL_ALLREDUCE=0
    ("hier_pipelined", False, [2, 2], True, "hier_pipelined"),    # explicit AIAK_ALLREDUCE_ALGO wins
])
def test_resolve_algorithm(algo, hier_flag, nodes, is_global, expected):
    cfg = Config(allreduce_algo=algo, hierarchical_allreduce=hier_flag)
    name, why = resolve_algorithm(cfg, fake_topology(nodes), is_global)
    assert name == expected, why
    assert why


def test_config_from_env_reaches_resolution(monkeypatch):
    monkeypatch.delenv("AIAK_ALLREDUCE_ALGO", raising=False)
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")
    assert resolve_algorithm(Config.from_env(), fake_topology([2, 2]), True)[0] == "hier_pipelined"
    monkeypatch.setenv("AIAK_ALLREDUCE_ALGO", "flat")
    assert resolve_algorithm(Config.from_env(), fake_topology([2, 2]), True)[0] == "flat"
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "0")
    monkeypatch.setenv("AIAK_ALLREDUCE_ALGO", "hier_staged")
    assert resolve_algorithm(Config.from_env(), fake_topology([2, 2]), True)[0] == "hier_staged"


# ---- end to end on an emulated cluster -------------------------------------------------------
def test_emulated_cluster_2x2_end_to_end():
    """hvd.allreduce with AIAK_ALLREDUCE_ALGO=hierarchical on 2 network-namespace nodes x 2
    ranks joined by a shaped 1 Gbit/s link: the node split comes from MPI itself (no
    HOROVOD_HOSTNAME), the shared window is real node-local memory, and the cross-node
    traffic crosses the emulated network."""
    from aiak_training.testing.cluster import EmulatedCluster, can_emulate

    ok, why = can_emulate()
    if not ok:
        pytest.skip(f"cannot emulate a cluster here: {why}")
    env = {k: v for k, v in env_with().items()
           if k in ("PYTHONPATH", "OMP_NUM_THREADS") or k.startswith("HOROVOD_STALL")}
    env.update(COMMON_ENV, AIAK_ALLREDUCE_ALGO="hierarchical", AIAK_TEST_LAYOUT="2,2",
               AIAK_TEST_EXPECT_ALGO="hier_pipelined", AIAK_TEST_REAL_NODES="1")
    with EmulatedCluster(nodes=2, ranks_per_node=2, rate_gbit=1.0, verify="off",
                         log=None) as cluster:
        cmd = cluster.mpiexec_args(4) + PYTEST + ["-k", "engine", SUITE]
        proc = cluster.run(cmd, env=env, timeout=240, capture_output=True, text=True,
                           cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    check_suite_output(out, 4, "hier_pipelined", 16)  # the 16 "engine" tests
    # Nothing skipped: the real-node topology test and the algorithm check both ran.
    assert not re.search(r"\d+ skipped", out), out[-3000:]
