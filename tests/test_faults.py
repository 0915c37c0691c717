"""Network faults on the emulated 2 nodes x 2 ranks cluster, and the parts that handle them.

* Unit tests (run anywhere): the tc command lines of the cluster's impairments, argument
  checks, the watchdog's probe and failure records, aiakrun's lost-host detection.
* Cluster tests (need root and network namespaces; skipped elsewhere with the reason from
  ``can_emulate()``), all through ``aiakrun`` inside the cluster:
  - 1% and 5% packet loss and 50 ms jitter during grouped allreduce (hierarchical on the
    global set, flat on a process set), DGC and overlapped optimizer steps: exact results;
  - a node's link taken down in the middle of a stream of allreduces: every rank ends
    (exit 75, collective watchdog) and the report names the lost host;
  - every process of a node SIGKILLed: aiakrun names the lost host;
  - a rank that never calls a collective: the stall inspector names it, the job ends.
  After each, nothing may be left: no process in the namespaces, and after the module no
  namespace, link or lock file of the run.

One cluster serves the whole module; every subprocess has a timeout.  The watchdog runs with
a short timeout here (``AIAK_COLLECTIVE_TIMEOUT_SECONDS=8``) to keep the file quick; the
default's bounds are measured in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

import pytest

from aiak_training.common.host import net
from aiak_training.common.job.records import read_failures
from aiak_training.runner.guard.supervise import LostHost, ProxyWatch
from aiak_training.runtime.diagnostics import watchdog as wd
from aiak_training.testing import cluster as cl
from aiak_training.testing.cluster import ClusterError, EmulatedCluster, can_emulate
from aiak_training.testing.cluster.namespaces import kill_netns_processes
from launch import JOBS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = os.path.join(REPO_ROOT, "tests", "scripts", "fault_ops.py")
STREAM = os.path.join(JOBS, "fault_stream.py")
AIAKRUN = [sys.executable, "-m", "aiak_training.runner.launch"]
WATCHDOG_S = 8  # AIAK_COLLECTIVE_TIMEOUT_SECONDS in these tests


# ------------------------------------------------------------------------------------------
# Impairment command lines and argument checks (no privileges needed)


def test_loss_bytecode() -> None:
    five = cl.loss_bytecode(5)
    fields = five.split(",")
    assert fields[0] == "6" and len(fields) == 7
    # EtherType check, random load, threshold = 5% of 2^32, drop (2) / pass (-1) verdicts.
    assert fields[1:3] == ["40 0 0 12", "21 0 3 2048"]
    assert fields[3] == f"32 0 0 {0xFFFFF000 + 56}"
    assert fields[4] == f"53 1 0 {round(0.05 * 2**32)}"
    assert fields[5:] == ["6 0 0 2", f"6 0 0 {2**32 - 1}"]
    assert cl.loss_bytecode(0).split(",")[4] == "53 1 0 0"  # never below 0: never drops
    assert cl.loss_bytecode(1).split(",")[4] == f"53 1 0 {round(0.01 * 2**32)}"


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (51, ValueError),
                                      (float("nan"), ValueError), ("1", TypeError),
                                      (True, TypeError), (None, TypeError)])
def test_loss_bytecode_rejects(bad: object, exc: type) -> None:
    with pytest.raises(exc):
        cl.loss_bytecode(bad)  # type: ignore[arg-type]


def test_impairment_command_lines() -> None:
    assert cl.loss_commands("tc", "aiak001n1", "aiak0", 1) == [
        ["tc", "-n", "aiak001n1", "qdisc", "add", "dev", "aiak0", "clsact"],
        ["tc", "-n", "aiak001n1", "filter", "add", "dev", "aiak0", "egress", "pref", "1",
         "bpf", "da", "bytecode", cl.loss_bytecode(1)]]
    assert cl.netem_commands("tc", "ns", "aiak0", "800e:", 10, 50) == [
        ["tc", "-n", "ns", "qdisc", "replace", "dev", "aiak0", "parent", "800e:1", "handle",
         "a1ac:", "netem", "limit", "100000", "delay", "10ms", "50ms"]]
    assert cl.netem_commands("tc", "ns", "aiak0", "800e:", 0, 50)[0][-2:] == ["0ms", "50ms"]
    assert cl.netem_commands("tc", "ns", "aiak0", "800e:", 20, 0)[0][-1] == "20ms"
    assert cl.restore_child_command("tc", "ns", "aiak0", "800e:", 6512144) == [
        "tc", "-n", "ns", "qdisc", "replace", "dev", "aiak0", "parent", "800e:1", "handle",
        "a1ac:", "bfifo", "limit", "6512144"]
    assert cl.link_command("ip", "ns", "aiak0", up=False) == [
        "ip", "-n", "ns", "link", "set", "dev", "aiak0", "down"]
    assert cl.link_command("ip", "ns", "aiak0", up=True)[-1] == "up"
    # The queue limit is what tc derives from "latency 50ms", so a pause never resizes it.
    assert cl.tbf_limit_bytes(1.0, 262144) == 6_250_000 + 262144
    assert cl.tbf_change_line("aiak0", "1000000kbit", 262144, 6512144) == (
        "qdisc change dev aiak0 root tbf rate 1000000kbit burst 262144 limit 6512144")
    assert cl.tbf_pause_line("aiak0", 6512144) == (
        "qdisc change dev aiak0 root tbf rate 8kbit burst 1600 limit 6512144 "
        "peakrate 16kbit mtu 1600")


def test_impair_and_link_arguments_checked_before_anything_runs() -> None:
    cluster = EmulatedCluster(2, 2, 1.0, log=None)  # never started: nothing is created
    for kwargs in ({"loss_pct": -0.5}, {"loss_pct": 60}, {"jitter_ms": -1},
                   {"jitter_ms": 20_000}, {"delay_ms": float("inf")}, {"nodes": [2]},
                   {"nodes": [-1]}, {"nodes": []}):
        with pytest.raises(ValueError):
            cluster.impair(**kwargs)  # type: ignore[arg-type]
    for kwargs in ({"loss_pct": "5"}, {"jitter_ms": True}, {"seed": 1.5}, {"nodes": "01"},
                   {"nodes": [True]}):
        with pytest.raises((TypeError, ValueError)):
            cluster.impair(**kwargs)  # type: ignore[arg-type]
    for bad in (2, -1, 1.0, True, "1"):
        with pytest.raises(ValueError):
            cluster.link_down(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            cluster.link_up(bad)  # type: ignore[arg-type]
    # Valid arguments on a cluster that is not running: a clear error, not a crash.
    with pytest.raises(ClusterError, match="not running"):
        cluster.impair(loss_pct=1)
    with pytest.raises(ClusterError, match="not running"):
        cluster.link_down(1)
    cluster.clear_impairments()  # a no-op before start


# ------------------------------------------------------------------------------------------
# Watchdog pieces (no MPI job needed)


def test_collective_timeout_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiak_training.common.config import Config
    monkeypatch.delenv("AIAK_COLLECTIVE_TIMEOUT_SECONDS", raising=False)
    monkeypatch.delenv("AIAK_LIVENESS_PROBE", raising=False)
    cfg = Config.from_env()
    assert (cfg.collective_timeout_s, cfg.liveness_probe) == (30.0, True)
    monkeypatch.setenv("AIAK_COLLECTIVE_TIMEOUT_SECONDS", "0")
    monkeypatch.setenv("AIAK_LIVENESS_PROBE", "off")
    cfg = Config.from_env()
    assert (cfg.collective_timeout_s, cfg.liveness_probe) == (0.0, False)
    for bad in ("-1", "soon"):
        monkeypatch.setenv("AIAK_COLLECTIVE_TIMEOUT_SECONDS", bad)
        with pytest.raises(ValueError, match="AIAK_COLLECTIVE_TIMEOUT_SECONDS"):
            Config.from_env()


def _peer(rank: int, port: int, host: str = "h1",
          addresses: tuple = ("127.0.0.1",)) -> wd.PeerInfo:
    return wd.PeerInfo(rank, host, addresses, ("lo",), port, 0)


def test_probe_answer_refusal_and_description() -> None:
    listener = wd._Listener(lambda: {"rank": 1, "age": 2.5})
    try:
        answered = wd.probe_peer(_peer(1, listener.port), same_host=False)
        assert answered.answered and answered.progress_age == 2.5
    finally:
        listener.close()
    # The port is closed now: "refused" means the process is gone.
    gone = wd.probe_peer(_peer(2, listener.port), same_host=False, connect_timeout=1)
    assert not gone.answered and gone.gone and "refused" in gone.problem
    off = wd.probe_peer(_peer(3, 0), same_host=False)
    assert not off.answered and "off" in off.problem
    text = wd.describe_unanswered([answered, gone,
                                   wd.PeerStatus(_peer(4, 1), False, problem="p", gone=True),
                                   wd.PeerStatus(_peer(5, 1, host="h2"), False, problem="q")])
    # One part per host, its ranks' distinct problems joined; who answered is not listed.
    assert text == (f"ranks 2, 4 (host h1) do not answer (its process is gone): "
                    f"{gone.problem} / p; rank 5 (host h2) does not answer: q"), text
    assert wd.describe_unanswered([answered]) == ""


def test_probe_of_a_silent_process() -> None:
    # A listening socket that never accepts: the host answers, the process does not.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        status = wd.probe_peer(_peer(1, silent.getsockname()[1]), same_host=False,
                               connect_timeout=1, reply_timeout=0.3)
    finally:
        silent.close()
    assert not status.answered and not status.gone
    assert "alive but not responding" in status.problem


def test_tcp_receive_age_reads_own_sockets() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname(), timeout=5)
    conn, _ = server.accept()
    try:
        conn.sendall(b"x")
        assert client.recv(1) == b"x"
        age = wd.tcp_receive_age({"127.0.0.1"})
        assert age is not None and 0 <= age < 5
        assert wd.tcp_receive_age({"192.0.2.77"}) is None  # no socket to that address
    finally:
        for s in (client, conn, server):
            s.close()


def test_failure_record_is_read_by_aiakrun(tmp_path) -> None:
    wd.write_failure_record(2, "n1", wd.WATCHDOG_EXIT_CODE,
                            "was stopped by the collective watchdog: no progress for 30 s",
                            directory=str(tmp_path))
    wd.write_failure_record(0, "n0", 1, "x", directory=str(tmp_path / "missing"))  # no-op
    (record,) = read_failures(str(tmp_path))
    assert (record.rank, record.host, record.returncode) == (2, "n1", 75)
    assert record.describe() == ("rank 2 (host n1) was stopped by the collective watchdog: "
                                 "no progress for 30 s")


def test_local_addresses_exclude_loopback() -> None:
    for name, addr in net.local_ipv4_addresses():
        assert name != "lo" and not addr.startswith("127.")
        assert net.interface_is_up(name) is True
    assert net.interface_is_up("no-such-if0") is None


# ------------------------------------------------------------------------------------------
# aiakrun's lost-host detection (logic only)


def _watch_with(ended: Dict[int, tuple], launcher_ended: Optional[float],
                hosts: int = 2) -> ProxyWatch:
    watch = ProxyWatch(os.getpid(), [])  # no hosts: no thread, nothing watched
    watch._hosts = [(f"h{i}", (2 * i, 2 * i + 1)) for i in range(hosts)]
    watch._seen = {1000 + i: i for i in range(hosts)}
    watch.ended = ended
    watch.launcher_ended = launcher_ended
    return watch


def test_lost_host_is_the_proxy_that_ended_clearly_first() -> None:
    lost = _watch_with({1: (10.00, 1001), 0: (10.08, 1000)}, 10.05).lost()
    assert lost == [LostHost("h1", (2, 3), 1001, pytest.approx(0.05))]
    assert lost[0].describe().startswith("lost host h1 (ranks 2-3): its MPI proxy (pid 1001) "
                                         "ended 0.05 s before the launcher")
    # The other proxy ended in the same wake-up as the launcher (or never): still h1.
    assert [h.host for h in _watch_with({1: (10.02, 1001), 0: (10.05, 1000)}, 10.05).lost()] \
        == ["h1"]
    assert [h.host for h in _watch_with({1: (10.02, 1001)}, 10.05).lost()] == ["h1"]
    # hydra tearing the job down itself: the proxies end together, nobody is to blame.
    assert _watch_with({0: (10.0, 1000), 1: (10.003, 1001)}, 10.05).lost() == []
    assert _watch_with({0: (10.0, 1000), 1: (10.03, 1001)}, 10.05, hosts=2).lost() != []
    assert _watch_with({0: (10.0, 1000), 1: (10.001, 1001), 2: (10.002, 1002)}, 10.05,
                       hosts=3).lost() == []
    # Not clearly before the launcher, or the launcher's end unknown: nobody.
    assert _watch_with({1: (10.045, 1001)}, 10.05).lost() == []
    assert _watch_with({1: (10.0, 1001)}, None).lost() == []
    assert _watch_with({}, 10.0).lost() == []
    assert LostHost("h", (5,), 1, 0.1).describe().startswith("lost host h (rank 5)")
    assert LostHost("h", (1, 4), 1, 0.1).describe().startswith("lost host h (ranks 1, 4)")


# ------------------------------------------------------------------------------------------
# On the emulated cluster


def _require_emulation() -> None:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("fault injection needs the emulated cluster, which needs root on Linux "
                    "(network namespaces, veth, tc); running as uid "
                    f"{os.geteuid() if hasattr(os, 'geteuid') else '?'}")
    ok, why = can_emulate()
    if not ok:
        pytest.skip(f"cannot emulate a cluster here: {why}")


@pytest.fixture(scope="module")
def cluster():
    _require_emulation()
    with EmulatedCluster(2, 2, "1gbit", verify="off", log=None) as c:
        prefix = c.prefix
        yield c
    assert prefix and cl.leftovers(prefix) == []


@pytest.fixture
def clean(cluster: EmulatedCluster):
    """The cluster with clean links before and after the test, and no process left."""
    yield cluster
    cluster.clear_impairments()
    for node in cluster.links_down:
        cluster.link_up(node)
    leftover = [p for ns in cluster.namespaces for p in _netns_pids(ns)]
    if leftover:  # report, then clean, so the next test starts clean anyway
        kill_netns_processes(cluster.namespaces)
    assert leftover == [], leftover


def _netns_pids(ns: str) -> List[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                         timeout=10).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _rank_env(**extra: str) -> Dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1",
           # Keep a hung test short; the cluster tests lower the watchdog's timeout too.
           "AIAK_COLLECTIVE_TIMEOUT_SECONDS": str(WATCHDOG_S),
           # Over an impaired link a remote node's ranks may start tens of seconds after the
           # local ones (lost connection attempts back off): not what these tests time.
           "HOROVOD_START_TIMEOUT": "180"}
    env.update(extra)
    return env


@pytest.mark.parametrize("impairment", [
    {"loss_pct": 1.0},
    {"loss_pct": 5.0},
    {"jitter_ms": 50.0},
], ids=["loss1", "loss5", "jitter50"])
def test_results_exact_under_impairment(clean: EmulatedCluster, impairment: dict) -> None:
    cluster = clean
    applied = cluster.impair(**impairment)
    shown = {ns: subprocess.run(["tc", "-n", ns, "filter", "show", "dev", cl.IFACE_NAME,
                                 "egress"], capture_output=True, text=True, timeout=10).stdout
             for ns in cluster.namespaces}
    if impairment.get("loss_pct"):
        # The drop filter is on every node's egress, with this loss's threshold.
        for ns, text in shown.items():
            assert cl.loss_bytecode(impairment["loss_pct"]) in text, (ns, text)
    else:
        assert applied["jitter_method"] in ("netem", "pauses")
        assert all("bpf" not in text for text in shown.values())
        # The link is seen paused (tbf at a trickle) or delayed (netem) within a few tries.
        seen = ""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not re.search(r"rate 8Kbit|netem", seen):
            seen = subprocess.run(["tc", "-n", cluster.namespaces[1], "qdisc", "show", "dev",
                                   cl.IFACE_NAME], capture_output=True, text=True,
                                  timeout=10).stdout
            time.sleep(0.01)
        assert re.search(r"rate 8Kbit|netem", seen), seen
    proc = cluster.run(AIAKRUN + ["-np", "4", sys.executable, OPS, "2"],
                       env=_rank_env(HOROVOD_HIERARCHICAL_ALLREDUCE="1",
                                     HOROVOD_LOG_LEVEL="info",
                                     AIAK_HIER_CHUNK_BYTES="65536",
                                     HOROVOD_FUSION_THRESHOLD="262144",
                                     AIAK_OVERLAP_MIN_BUCKET_BYTES="65536"),
                       timeout=240, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    oks = re.findall(r"FAULT_OPS OK rank=(\d) host=(\S+) grouped=6 grouped_subset=(\d+) "
                     r"dgc=2 overlap=2", output)
    assert sorted(int(r) for r, _, _ in oks) == [0, 1, 2, 3], output[-4000:]
    # The global set ran the hierarchical algorithm (the process set runs flat).
    assert "allreduce algorithm: hier_pipelined" in output, output[-4000:]
    hosts = {int(r): h for r, h, _ in oks}
    assert hosts[0] == hosts[1] == cluster.node_names[0]
    assert hosts[2] == hosts[3] == cluster.node_names[1]
    if impairment.get("loss_pct"):
        # Packets were really dropped, at about the asked rate.
        stats = subprocess.run(["tc", "-s", "-n", cluster.namespaces[0], "qdisc", "show",
                                "dev", cl.IFACE_NAME], capture_output=True, text=True,
                               timeout=10).stdout
        m = re.search(r"qdisc clsact.*?Sent \d+ bytes (\d+) pkt \(dropped (\d+)", stats, re.S)
        assert m, stats
        sent, dropped = int(m.group(1)), int(m.group(2))
        assert sent > 1000 and dropped > 0, stats
        assert dropped / (sent + dropped) < 3 * impairment["loss_pct"] / 100, stats


def _start_stream(cluster: EmulatedCluster, out_dir: str, mode: str = "stream",
                  **env: str) -> tuple:
    """aiakrun in a thread; returns (thread, result dict, start time)."""
    result: dict = {}

    def run() -> None:
        try:
            result["proc"] = cluster.run(AIAKRUN + ["-np", "4", sys.executable, STREAM, mode,
                                                   out_dir],
                                         env=_rank_env(**env), timeout=150, reap=False,
                                         capture_output=True, text=True)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            result["error"] = exc
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and thread.is_alive():
        if all(os.path.exists(os.path.join(out_dir, f"ready.{r}")) for r in range(4)):
            break
        time.sleep(0.1)
    else:
        thread.join(timeout=160)
        raise AssertionError(f"the ranks did not start: {result}")
    return thread, result


def _rank_pids(out_dir: str) -> Dict[int, int]:
    pids = {}
    for r in range(4):
        with open(os.path.join(out_dir, f"pid.{r}")) as f:
            pids[r] = int(f.read().split()[0])
    return pids


def _watch_exits(pids: Dict[int, int], since: float, limit: float) -> Dict[int, float]:
    """Seconds after ``since`` at which each pid was gone (or a zombie)."""
    gone: Dict[int, float] = {}
    while len(gone) < len(pids) and time.monotonic() - since < limit:
        for rank, pid in pids.items():
            if rank in gone:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "gone"
            if state in ("gone", "Z", "X"):
                gone[rank] = time.monotonic() - since
        time.sleep(0.05)
    return gone


def _finish(thread: threading.Thread, result: dict) -> subprocess.CompletedProcess:
    thread.join(timeout=170)
    assert not thread.is_alive(), "aiakrun did not end"
    if "error" in result:
        raise result["error"]
    return result["proc"]


def test_link_down_mid_collective(clean: EmulatedCluster, tmp_path) -> None:
    cluster = clean
    thread, result = _start_stream(cluster, str(tmp_path))
    pids = _rank_pids(str(tmp_path))
    fault = time.monotonic()
    cluster.link_down(1)
    exits = _watch_exits(pids, fault, WATCHDOG_S + 30)
    proc = _finish(thread, result)
    ended = result["ended"] - fault
    output = proc.stdout + proc.stderr
    # Every rank ended by itself (the watchdog), the cut-off node's ranks too, in bounded time.
    assert sorted(exits) == [0, 1, 2, 3], (exits, output[-5000:])
    assert max(exits.values()) < WATCHDOG_S + 15, exits
    assert min(exits.values()) >= WATCHDOG_S - 1, exits  # not before the timeout
    assert proc.returncode == wd.WATCHDOG_EXIT_CODE, output[-5000:]
    assert ended < WATCHDOG_S + 25, ended
    report = [ln for ln in output.splitlines() if ln.startswith("aiakrun: ")]
    lost, kept = cluster.node_names[1], cluster.node_names[0]
    # The report names the lost host: node 0's ranks cannot reach it, and node 1's ranks see
    # their own link down.
    assert any(re.search(rf"rank [01] \(host {kept}\) was stopped by the collective watchdog.*"
                         rf"ranks 2, 3 \(host {lost}\) do not answer", ln) for ln in report), \
        report
    assert any(re.search(rf"rank [23] \(host {lost}\) was stopped by the collective watchdog.*"
                         rf"this host's network interface {cl.IFACE_NAME} is down", ln)
               for ln in report), report
    # On each node at least one rank was ended by its own watchdog.  Its node-mate either
    # fired as well or, when the first one exited before the mate's probe finished (a 2 s
    # connect timeout on node 0), was stopped by hydra's proxy on that node, which kills the
    # local ranks once one dies by a signal.  Either way no rank may fail in any other manner.
    failed = [(int(r), how) for r, how in re.findall(
        r"rank (\d) \(host \S+\) (exited with .*|was stopped by the collective watchdog.*)",
        "\n".join(report))]
    fired = {r for r, how in failed if how.startswith("was stopped")}
    assert fired & {0, 1} and fired & {2, 3}, report
    assert {r for r, _ in failed} == fired, report
    assert all(how.startswith("was stopped") or how == "exited with exit code 75"
               for _, how in failed), report
    # The first of node 0's ranks to end was not asked to stop, so its wrapper reported it.
    assert any(r in (0, 1) and how == "exited with exit code 75" for r, how in failed), report
    assert "UNEXPECTED" not in output
    time.sleep(1.0)  # aiakrun has returned: its sweep is done
    assert [p for ns in cluster.namespaces for p in _netns_pids(ns)] == []


@pytest.mark.parametrize("victims", ["node", "ranks"])
def test_node_processes_sigkilled(clean: EmulatedCluster, tmp_path, victims: str) -> None:
    cluster = clean
    thread, result = _start_stream(cluster, str(tmp_path))
    pids = _rank_pids(str(tmp_path))
    fault = time.monotonic()
    if victims == "node":  # everything of the job on node 1: proxy, wrappers, ranks
        targets = _netns_pids(cluster.namespaces[1])
    else:  # only the ranks' own processes
        targets = [pids[2], pids[3]]
    for pid in targets:
        os.kill(pid, signal.SIGKILL)
    exits = _watch_exits(pids, fault, 60)
    proc = _finish(thread, result)
    ended = result["ended"] - fault
    output = proc.stdout + proc.stderr
    assert sorted(exits) == [0, 1, 2, 3] and max(exits.values()) < 30, (exits, output[-4000:])
    assert proc.returncode != 0 and ended < 30, (ended, output[-4000:])
    report = "\n".join(ln for ln in output.splitlines() if ln.startswith("aiakrun: job failed"))
    if victims == "node":
        assert f"lost host {cluster.hosts[1]} (ranks 2-3)" in report, output[-4000:]
    else:
        assert re.search(rf"rank [23] \(host {cluster.node_names[1]}\) exited with signal "
                         "SIGKILL", report), output[-4000:]
    time.sleep(1.0)
    assert [p for ns in cluster.namespaces for p in _netns_pids(ns)] == []


def test_rank_that_never_calls_a_collective(clean: EmulatedCluster, tmp_path) -> None:
    cluster = clean
    thread, result = _start_stream(cluster, str(tmp_path), mode="stall",
                                   HOROVOD_STALL_CHECK_TIME_SECONDS="2",
                                   HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="5")
    start = time.monotonic()
    proc = _finish(thread, result)
    ended = result["ended"] - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert ended < 5 + 20, ended
    # The stall inspector (on rank 0) names rank 3 and the tensor it never submitted.
    assert "Missing ranks:" in output, output[-4000:]
    assert re.search(r"^\[0\] 3: \[allreduce\.waits_for_rank_3\]", output, re.M), output[-4000:]
    assert len(re.findall(r"stall shutdown raised HorovodInternalError", output)) >= 1
    assert "collective watchdog" not in output  # the engine kept cycling: not a hang
    assert "UNEXPECTED" not in output
    time.sleep(1.0)
    assert [p for ns in cluster.namespaces for p in _netns_pids(ns)] == []
