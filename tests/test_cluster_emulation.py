"""Tests of the emulated-cluster tool (aiak_training/testing/cluster/).

The parsing tests run anywhere.  The cluster tests need root, iproute2 and working network
namespaces; elsewhere they are skipped with the reason from ``can_emulate()``.  They build
small clusters (2 nodes, 1 Gbit/s) and finish in well under a minute on 2 cores.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from aiak_training.testing import cluster as cl
from aiak_training.testing.cluster import namespaces as cl_ns
from aiak_training.testing.cluster import (
    ClusterError,
    EmulatedCluster,
    can_emulate,
    mpiexec_args,
    parse_cli,
    parse_rate,
    parse_size,
    tbf_burst_bytes,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------
# Parsing (no privileges needed)


@pytest.mark.parametrize("text, gbit", [
    ("1gbit", 1.0),
    ("500mbit", 0.5),
    ("5gbit", 5.0),
    ("5Gbit/s", 5.0),
    ("2.5gbit", 2.5),
    ("100000kbit", 0.1),
    ("10g", 10.0),
    ("3", 3.0),
])
def test_parse_rate(text: str, gbit: float) -> None:
    assert parse_rate(text) == pytest.approx(gbit)


@pytest.mark.parametrize("text", ["1gbps", "100MB", "fast", "", "-1gbit", "0gbit", "1 furlong"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rate(text)


def test_parse_size_and_burst() -> None:
    assert parse_size("256kb") == 256 * 1024
    assert parse_size("1mb") == 1024 * 1024
    assert parse_size("300000") == 300000
    with pytest.raises(ValueError):
        parse_size("lots")
    # Well above one 64 KiB GSO segment at every rate, growing with the rate, bounded.
    assert tbf_burst_bytes(0.1) == tbf_burst_bytes(1.0) == 256 * 1024
    assert tbf_burst_bytes(10.0) > tbf_burst_bytes(1.0)
    assert tbf_burst_bytes(1000.0) == 4 * 1024 * 1024


def test_parse_cli() -> None:
    args = parse_cli(["--nodes", "4", "--ranks-per-node", "2", "--rate", "500mbit",
                      "--require-rate", "--", "pytest", "-x", "--nodes", "9"])
    assert (args.nodes, args.ranks_per_node) == (4, 2)
    assert args.rate == pytest.approx(0.5)
    assert args.verify == "require"
    assert args.command == ["pytest", "-x", "--nodes", "9"]  # options after -- untouched
    args = parse_cli(["--rate", "5gbit", "--no-verify", "--burst", "1mb", "--", "true"])
    assert (args.rate, args.verify, args.burst) == (5.0, "off", 1024 * 1024)
    assert parse_cli(["--", "true"]).verify == "warn"
    assert parse_cli(["--check"]).command == []


@pytest.mark.parametrize("argv", [
    [],                                   # no command
    ["--rate", "1gbps", "--", "true"],    # byte unit
    ["--nodes", "0", "--", "true"],
    ["--ranks-per-node", "0", "--", "true"],
    ["--require-rate", "--no-verify", "--", "true"],
])
def test_parse_cli_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_cli(argv)
    assert exc.value.code == 2


def test_mpiexec_args_from_env() -> None:
    env = {
        "AIAK_CLUSTER_HOSTS": "192.0.2.1:2,192.0.2.2:2",
        "AIAK_CLUSTER_LAUNCHER_EXEC": "/tmp/x/launch_agent",
        "AIAK_CLUSTER_IFACE": "aiak0",
        "AIAK_CLUSTER_NODES": "2",
        "AIAK_CLUSTER_RANKS_PER_NODE": "2",
        "AIAK_CLUSTER_LINK_GBIT": "0.956",
        "AIAK_CLUSTER_MPIEXEC": "/opt/mpich/bin/mpiexec",
    }
    assert mpiexec_args(env=env) == [
        "/opt/mpich/bin/mpiexec", "-launcher", "ssh", "-launcher-exec", "/tmp/x/launch_agent",
        "-iface", "aiak0", "-hosts", "192.0.2.1:2,192.0.2.2:2", "-n", "4"]
    assert mpiexec_args(3, env=env)[-2:] == ["-n", "3"]
    with pytest.raises(ClusterError, match="not inside an emulated cluster"):
        mpiexec_args(env={})


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        EmulatedCluster(0, 1, 1.0)
    with pytest.raises(ValueError):
        EmulatedCluster(2, 1, "1gbps")
    with pytest.raises(ValueError):
        EmulatedCluster(2, 1, 1.0, verify="maybe")
    with pytest.raises(ValueError):
        EmulatedCluster(2, 1, 1.0, burst_bytes=1500)


def test_requirements_reported_without_root(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, why = can_emulate()
    assert not ok and "root" in why
    assert cl.main(["--nodes", "2", "--", "true"]) == 2
    assert "needs root" in capsys.readouterr().err
    with pytest.raises(cl.ClusterUnavailable):
        EmulatedCluster(2, 1, 1.0).start()


# ------------------------------------------------------------------------------------------
# Real clusters (root only)


def _require_emulation() -> None:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("cluster emulation needs root on Linux (network namespaces, veth, tc); "
                    f"running as uid {os.geteuid() if hasattr(os, 'geteuid') else '?'}")
    ok, why = can_emulate()
    if not ok:
        pytest.skip(f"cannot emulate a cluster here: {why}")


def _leftovers(prefix: str) -> list[str]:
    """Namespaces or root-namespace links with the run's prefix, plus its lock file."""
    found = [n for n in cl_ns.list_netns() + cl_ns.list_links() if n.startswith(prefix)]
    if os.path.exists(os.path.join(cl.LOCK_DIR, prefix + ".lock")):
        found.append(prefix + ".lock")
    return found


_MPI_PROBE = r'''
import json, socket, time
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
local = comm.Split_type(MPI.COMM_TYPE_SHARED)


def wait_politely():
    # Idle ranks sleep instead of busy-polling in a barrier: 4 ranks share 2 cores.
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def pingpong(a, b, nbytes=8 << 20, iters=4):
    buf = np.zeros(nbytes, dtype=np.uint8)
    result = None
    if rank in (a, b):
        peer = b if rank == a else a
        for it in range(iters + 1):  # the first round trip is a warm-up
            if it == 1:
                t0 = MPI.Wtime()
            if rank == a:
                comm.Send(buf, dest=peer)
                comm.Recv(buf, source=peer)
            else:
                comm.Recv(buf, source=peer)
                comm.Send(buf, dest=peer)
        result = 2 * nbytes * iters / (MPI.Wtime() - t0) / 1e9
    wait_politely()
    return result


info = comm.gather({"rank": rank, "host": socket.gethostname(), "local_size": local.Get_size()})
intra = pingpong(0, 1)
cross = pingpong(0, 2)
if rank == 0:
    print("RESULT " + json.dumps({"ranks": info, "intra_gbs": intra, "cross_gbs": cross}))
'''

# Runs inside node 0: builds the mpiexec command from the AIAK_CLUSTER_* environment, as a
# benchmark would, and launches the probe with it.
_DRIVER = r'''
import os, sys
from aiak_training.testing.cluster import mpiexec_args
argv = mpiexec_args() + [sys.executable, sys.argv[1]]
os.execv(argv[0], argv)
'''


def test_two_by_two_cluster_mpi(tmp_path) -> None:
    """2 nodes x 2 ranks at 1 Gbit/s: node identity, local size, and the shaping applies."""
    _require_emulation()
    pytest.importorskip("mpi4py")
    pytest.importorskip("numpy")
    probe = tmp_path / "mpi_probe.py"
    probe.write_text(_MPI_PROBE)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT,
                                                       os.environ.get("PYTHONPATH")]))}
    # verify="warn": the rate check itself is exact on an idle machine, but one busy CPU can
    # hold the TCP probe 20-25% under the shaped rate.  What this test asserts is that
    # shaping applies (never above the rate) and that the link is measured and exported.
    with EmulatedCluster(2, 2, "1gbit", verify="warn") as cluster:
        prefix = cluster.prefix
        assert prefix and re.fullmatch(r"aiak\d{3}", prefix)
        assert cluster.hosts == ["192.0.2.1", "192.0.2.2"]
        assert cluster.measured_gbit is not None and 0.5 <= cluster.measured_gbit <= 1.2
        assert cluster.env["AIAK_CLUSTER_HOSTS"] == "192.0.2.1:2,192.0.2.2:2"
        assert float(cluster.env["AIAK_CLUSTER_LINK_GBIT"]) == pytest.approx(
            cluster.measured_gbit, rel=1e-3)
        assert _leftovers(prefix)  # sanity: the helper does see a live cluster

        proc = cluster.run([sys.executable, "-c", _DRIVER, str(probe)], env=env, timeout=60,
                           capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        result = json.loads(line[len("RESULT "):])
        for r in result["ranks"]:
            assert r["host"] == cluster.node_names[r["rank"] // 2], result["ranks"]
            assert r["local_size"] == 2, result["ranks"]
        assert len({r["host"] for r in result["ranks"]}) == 2
        # 1 Gbit/s is 0.125 GB/s: cross-node must be shaped, intra-node (shared memory) not.
        assert result["cross_gbs"] < 0.3, result
        assert result["intra_gbs"] > 3 * result["cross_gbs"], result
    assert _leftovers(prefix) == []


def test_teardown_after_failure_and_timeout() -> None:
    _require_emulation()
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, 1, 1.0, verify="off", log=None) as cluster:
            prefix = cluster.prefix
            assert prefix is not None
            # Node identity holds on node 1 too, and a failing command is just a status.
            proc = cluster.run(["sh", "-c", "hostname; exit 3"], node=1, capture_output=True,
                               text=True)
            assert proc.returncode == 3
            assert proc.stdout.strip() == cluster.node_names[1]
            # A timed-out command is killed, with everything it started in the namespaces.
            with pytest.raises(subprocess.TimeoutExpired):
                cluster.run(["sh", "-c", "sleep 30 & sleep 30"], timeout=1)
            for ns in cluster.namespaces:
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True).stdout.split()
                assert pids == [], (ns, pids)
            raise RuntimeError("boom")
    assert _leftovers(prefix) == []


def test_cli_sigint_tears_down() -> None:
    _require_emulation()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    cli = subprocess.Popen(
        [sys.executable, "-m", "aiak_training.testing.cluster", "--nodes", "2",
         "--ranks-per-node", "1", "--rate", "1gbit", "--no-verify", "--", "sleep", "60"],
        cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    prefix = None
    try:
        deadline = time.monotonic() + 30
        assert cli.stderr is not None
        while time.monotonic() < deadline:
            line = cli.stderr.readline()
            if not line:
                break
            m = re.search(r"(aiak\d{3}): up:", line)
            if m:
                prefix = m.group(1)
                break
        assert prefix, "the CLI did not report the cluster as up"
        assert len([n for n in cl_ns.list_netns() if n.startswith(prefix)]) == 3  # 2 nodes + switch
        # Interrupt while the command is running in node 0, so there is a job to kill.
        while time.monotonic() < deadline and not subprocess.run(
                ["ip", "netns", "pids", f"{prefix}n0"], capture_output=True,
                text=True).stdout.split():
            time.sleep(0.05)
        cli.send_signal(signal.SIGINT)
        rc = cli.wait(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert rc == 130
    assert _leftovers(prefix) == []


def test_parallel_runs_get_distinct_prefixes() -> None:
    _require_emulation()
    a = cl_ns.claim_prefix()
    try:
        b = cl_ns.claim_prefix()
        cl_ns.release_prefix(b)
        assert a != b
    finally:
        cl_ns.release_prefix(a)
