"""Elastic training on the emulated cluster (network namespaces, 1 Gbit/s links; root only).

One job over 4 emulated nodes: it starts on nodes 0-2, node 2 is SIGKILLed as a whole
mid-epoch (every process of the job in its namespace), the job continues on nodes 0-1
from the last commit, then the discovery script lists node 3 and the job grows to it.  The
final parameters must equal an exact single-process replay of the committed steps, no
committed step may be lost, and the log must name the lost host.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from aiak_training.testing import cluster as cl
from aiak_training.testing.cluster import EmulatedCluster, can_emulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import elastic_exact  # noqa: E402
from elastic_support import (SCRIPT, ElasticJob, check_epochs, discovery_script,  # noqa: E402
                             write_hosts)
from launch import REPO  # noqa: E402


def _require_emulation() -> None:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the emulated cluster needs root on Linux (network namespaces, veth, tc)")
    ok, why = can_emulate()
    if not ok:
        pytest.skip(f"cannot emulate a cluster here: {why}")


def _netns_pids(ns: str):
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                         timeout=10).stdout
    return [int(p) for p in out.split() if p.isdigit()]


class _ClusterProcess:
    """``cluster.run`` in a thread, looking like a Popen to ElasticJob."""

    def __init__(self, cluster: EmulatedCluster, cmd, env, log):
        self.returncode = None
        self.pid = None

        def run() -> None:
            try:
                done = cluster.run(cmd, env=env, timeout=400, stdout=log,
                                   stderr=subprocess.STDOUT)
                self.returncode = done.returncode
            except subprocess.TimeoutExpired:
                self.returncode = -signal.SIGKILL
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("aiakrun", timeout)
        return self.returncode


def test_node_killed_then_node_added_on_emulated_cluster(tmp_path):
    _require_emulation()
    with EmulatedCluster(4, 1, "1gbit", verify="off", log=None) as cluster:
        hosts = cluster.hosts
        script, host_file = discovery_script(tmp_path, [f"{h}:1" for h in hosts[:3]])
        env = {"STEP_SLEEP": "0.25", "COMMIT_EVERY": "2", "EPOCHS": "6",
               "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests", "parallel")]),
               "OMP_NUM_THREADS": "1"}
        job = ElasticJob(["-np", "3", "--min-np", "2", "--max-np", "3",
                          "--host-discovery-script", script, sys.executable, SCRIPT],
                         tmp_path, env,
                         runner=lambda cmd, full_env, log: _ClusterProcess(
                             cluster, cmd, {k: v for k, v in full_env.items()
                                            if k not in cluster.env}, log))
        before = job.wait_steps(4, timeout=180)
        for pid in _netns_pids(cluster.namespaces[2]):
            os.kill(pid, signal.SIGKILL)
        job.wait_log(f"lost host {hosts[2]}", timeout=60)
        job.wait_log("round 2: 2 rank(s)", timeout=120)
        write_hosts(host_file, [f"{h}:1" for h in (hosts[0], hosts[1], hosts[3])])
        job.wait_log("round 3: 3 rank(s)", timeout=180)
        code = job.finish(timeout=300)
        log = job.log()
        assert code == 0, log[-4000:]
        assert f"lost host {hosts[2]}: worker" in log and "exited with signal SIGKILL" in log
        with open(job.out) as f:
            out = json.load(f)
        history = [(e, size, [list(p) for p in parts]) for e, size, parts in out["history"]]
        sizes = [h[1] for h in history]
        two = sizes.index(2)
        three = sizes.index(3, two)
        assert two >= before and set(sizes[:two]) == {3} and set(sizes[two:three]) == {2}
        assert set(sizes[three:]) == {3} and out["size"] == 3
        check_epochs(history, elastic_exact.N_SAMPLES, 6)
        assert elastic_exact.replay(history) == out["params"]
        time.sleep(1.0)
        assert [p for ns in cluster.namespaces for p in _netns_pids(ns)] == []
        prefix = cluster.prefix
    assert cl.leftovers(prefix) == []
