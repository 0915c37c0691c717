"""The engine's reduce-scatter and allgather, flat and hierarchical (issue 32).

tests/scripts/sharded_collectives.py checks exact values on every rank against numpy results
it computes itself; here it runs on virtual-node layouts (HOROVOD_HOSTNAME per rank) over MPI
and over Gloo, and asserts which path the engine took.  The selection rule is tested
without MPI, and tests/scripts/sharded_bitwise.py compares the sharded optimizer with the
dense one bit for bit on 2x2.
"""
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from aiak_training.allreduce.hier_scatter import hierarchical_applies
from aiak_training.common.config import Config
from launch import REPO, env_with, mpiexec

SCRIPT = "tests/scripts/sharded_collectives.py"


def mpi_sections(hosts, argv, env=None):
    """mpiexec argv running ``argv`` with one rank per entry of ``hosts`` (its
    HOROVOD_HOSTNAME, in rank order), so ranks of one node need not be neighbours."""
    cmd = [mpiexec()]
    for i, host in enumerate(hosts):
        if i:
            cmd.append(":")
        cmd += ["-n", "1", "-env", "HOROVOD_HOSTNAME", host]
        for k, v in (env or {}).items():
            cmd += ["-env", k, v]
        cmd += argv
    return cmd


def check_ok(proc, nranks, path):
    assert proc.returncode == 0, proc.stdout[-6000:]
    found = re.findall(r"sharded collectives ok: rank (\d+) path (\w+) checks (\d+)",
                       proc.stdout)
    assert sorted(int(r) for r, _, _ in found) == list(range(nranks)), proc.stdout[-4000:]
    assert {p for _, p, _ in found} == {path}
    assert {c for _, _, c in found} == {"13"}


@pytest.mark.parametrize("hosts, env, path", [
    (["node0", "node0", "node1", "node1"], {}, "hier"),           # 2x2, node-major ranks
    (["node0", "node1", "node0", "node1"], {}, "hier"),           # 2x2, interleaved ranks
    (["node0", "node0", "node1", "node1"], {"AIAK_ALLREDUCE_ALGO": "flat"}, "flat"),
    (["node0", "node0"], {}, "flat"),                             # one node
    (["node0", "node0", "node1"], {}, "flat"),                    # unequal nodes
], ids=["2x2", "2x2-interleaved", "2x2-flat", "1x2", "2+1"])
def test_mpi_layouts(hosts, env, path):
    proc = subprocess.run(mpi_sections(hosts, [sys.executable, SCRIPT, path], env),
                          env=env_with(), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    check_ok(proc, len(hosts), path)


@pytest.mark.parametrize("hosts, path", [("node0:2,node1:2", "hier"), (None, "flat")],
                         ids=["2x2", "1x2"])
def test_gloo_layouts(hosts, path):
    np_ = 4 if hosts else 2
    cmd = [sys.executable, "-m", "aiak_training.runner.launch", "--gloo", "-np", str(np_)]
    if hosts:
        cmd += ["-H", hosts, "--virtual-hosts"]
    proc = subprocess.run(cmd + [sys.executable, SCRIPT, path], env=env_with(), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    check_ok(proc, np_, path)


def topo(node_sizes):
    return SimpleNamespace(num_nodes=len(node_sizes), local_size=node_sizes[0],
                           is_homogeneous=len(set(node_sizes)) == 1)


@pytest.mark.parametrize("algo, hier_flag, nodes, is_global, expected", [
    ("auto", None, [2, 2], True, True),
    ("auto", True, [3, 3], True, True),
    ("hier_staged", None, [2, 2], True, True),
    ("auto", None, [4], True, False),            # one node
    ("auto", None, [1, 1, 1], True, False),      # one rank per node
    ("auto", None, [2, 1], True, False),         # unequal nodes
    ("auto", None, [2, 2], False, False),        # a process set
    ("flat", None, [2, 2], True, False),         # AIAK_ALLREDUCE_ALGO=flat
    ("auto", False, [2, 2], True, False),        # HOROVOD_HIERARCHICAL_ALLREDUCE=0
    ("hierarchical", False, [2, 2], True, True),  # the explicit setting wins
])
def test_selection(algo, hier_flag, nodes, is_global, expected):
    config = Config(allreduce_algo=algo, hierarchical_allreduce=hier_flag)
    assert hierarchical_applies(config, topo(nodes), is_global) is expected


@pytest.mark.parametrize("env, identical", [({}, True), ({"AIAK_ALLREDUCE_ALGO": "flat"}, False)],
                         ids=["hierarchical", "flat"])
def test_sharded_optimizer_bitwise_on_2x2(env, identical):
    """On 2 nodes x 2 ranks the hierarchical reduce-scatter adds the terms as the dense path's
    hierarchical allreduce does (the node's pair, then the two nodes), so 20 Adam steps agree
    bit for bit; flat collectives add them in other orders and differ in the last bits only."""
    cmd = mpi_sections(["node0", "node0", "node1", "node1"],
                       [sys.executable, "tests/scripts/sharded_bitwise.py"], env)
    proc = subprocess.run(cmd, env=env_with(), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    found = re.search(r"bit-identical (True|False) max difference (\S+)", proc.stdout)
    assert found, proc.stdout[-3000:]
    assert found.group(1) == str(identical), found.group(0)
    assert float(found.group(2)) < 1e-6
