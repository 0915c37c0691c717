"""The emulated cluster itself: :class:`EmulatedCluster` creates the namespaces, links and
shaping, checks the link rate, runs commands on node 0 and tears everything down."""
from __future__ import annotations

import atexit
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Callable, Mapping, Sequence

from aiak_training.testing import launch_agent
from aiak_training.testing.cluster.constants import (IFACE_NAME, MAX_NODES, MPI_TRANSPORT_ENV,
                                                     LINK_RATE_PORT, SUBNET, ClusterError,
                                                     ClusterUnavailable, LinkRateMismatch)
from aiak_training.testing.cluster.impairments import LinkImpairments, LinkStaller
from aiak_training.testing.cluster.mpiexec import find_mpiexec, mpiexec_args
from aiak_training.testing.cluster.namespaces import (claim_prefix, cleanup_stale, destroy,
                                                      kill_netns_processes, release_prefix,
                                                      run_quiet)
from aiak_training.testing.cluster.rates import parse_rate, tbf_burst_bytes, tc_rate
from aiak_training.testing.cluster.requirements import static_requirements, tool_paths


# --------------------------------------------------------------------------------------------
# Programs run inside the namespaces: the launch agent (launch_agent.py) and the link-rate program
# (link_rate.py), both next to this file and run by path with an isolated interpreter.

# testing/, the folder above this package.
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_AGENT_PROGRAM = os.path.join(_HERE, "launch_agent.py")
_LINK_RATE_PROGRAM = os.path.join(_HERE, "link_rate.py")

# `sh -c` wrapper that sets the node hostname in a fresh UTS namespace, then execs the command.
_HOSTNAME_EXEC = '"$2" "$1" || exit 125; shift 2; exec "$@"'


# --------------------------------------------------------------------------------------------
# The cluster



def default_log(message: str) -> None:
    print(f"[aiak-cluster] {message}", file=sys.stderr, flush=True)


class EmulatedCluster(LinkImpairments):
    """``nodes`` x ``ranks_per_node`` emulated cluster joined by links of ``rate_gbit``.

    Use as a context manager (or call :meth:`start` / :meth:`teardown`).  After start:

    * ``hosts``: hydra host names (node IP addresses), ``host_spec``: ``"ip:L,ip:L"``;
    * ``node_names``: hostnames the ranks see, ``namespaces``: namespace names;
    * ``measured_gbit``: measured node0 -> node1 TCP goodput (None with one node or
      ``verify="off"``); ``env``: the variables set for commands.

    ``verify``: ``"require"`` raises :class:`LinkRateMismatch` when the measured rate is off
    by more than ``tolerance`` (relative), ``"warn"`` (default) prints a loud warning,
    ``"off"`` skips the measurement (the qdisc settings are still checked).
    """

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int,
        rate_gbit: float | str,
        *,
        verify: str = "warn",
        tolerance: float = 0.2,
        measure_seconds: float = 1.0,
        prefix: str | None = None,
        handle_signals: bool = True,
        burst_bytes: int | None = None,
        mpi_env: Mapping[str, str] | None = None,
        hydra_env: bool = True,
        log: Callable[[str], None] | None = default_log,
    ) -> None:
        if not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be an integer in 1..{MAX_NODES}, got {nodes!r}")
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if verify not in ("require", "warn", "off"):
            raise ValueError(f"verify must be 'require', 'warn' or 'off', got {verify!r}")
        if not 0 < tolerance < 1:
            raise ValueError(f"tolerance must be in (0, 1), got {tolerance!r}")
        if not 0.1 <= measure_seconds <= 30:
            raise ValueError(f"measure_seconds must be in [0.1, 30], got {measure_seconds!r}")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.rate_gbit = parse_rate(rate_gbit)
        self.burst_bytes = tbf_burst_bytes(self.rate_gbit) if burst_bytes is None else burst_bytes
        if self.burst_bytes < 64 * 1024:
            raise ValueError("burst_bytes must be at least 64 KiB (one GSO segment), "
                             f"got {self.burst_bytes}")
        self.verify = verify
        self.tolerance = tolerance
        self.measure_seconds = measure_seconds
        self.mpi_env = dict(MPI_TRANSPORT_ENV if mpi_env is None else mpi_env)
        self.hydra_env = hydra_env
        self._requested_prefix = prefix
        self._handle_signals = handle_signals
        self._log_fn = log
        self.prefix: str | None = None
        self.measured_gbit: float | None = None
        self.link_report: dict[str, object] = {}
        self.env: dict[str, str] = {}
        self._tmpdir: str | None = None
        self._agent: str | None = None
        self._tools: dict[str, str] = {}
        self._started = False
        self._torn_down = False
        self._prev_handlers: dict[int, object] = {}
        self._lock = threading.Lock()
        # Impairments (see impair()): what is applied, and what must be undone.
        self._impairment: dict[str, object] = {}
        self._stallers: list[LinkStaller] = []
        self._gso_segs: dict[int, str] = {}       # node -> gso_max_segs before impair()
        self._netem_nodes: dict[int, str] = {}    # node -> tbf handle with netem under it
        self._loss_nodes: list[int] = []
        self._links_down: set[int] = set()
        self._netem: bool | None = None

    # -- names ------------------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        return [f"{self.prefix}n{i}" for i in range(self.nodes)]

    @property
    def node_names(self) -> list[str]:
        """Hostnames the ranks of each node see (the namespace names: unique per run)."""
        return self.namespaces

    @property
    def addresses(self) -> list[str]:
        return [f"{SUBNET}{i + 1}" for i in range(self.nodes)]

    @property
    def hosts(self) -> list[str]:
        """Host names hydra must be given: the node addresses (resolvable without DNS)."""
        return self.addresses

    @property
    def host_spec(self) -> str:
        return ",".join(f"{h}:{self.ranks_per_node}" for h in self.hosts)

    @property
    def switch_namespace(self) -> str:
        """Namespace that holds the bridge (the emulated switch) and the switch-side veths."""
        return f"{self.prefix}sw"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def _veth(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def __repr__(self) -> str:
        return (f"EmulatedCluster(nodes={self.nodes}, ranks_per_node={self.ranks_per_node}, "
                f"rate_gbit={self.rate_gbit:g}, prefix={self.prefix!r}, "
                f"measured_gbit={self.measured_gbit!r})")

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _log(self, message: str) -> None:
        if self._log_fn is not None:
            self._log_fn(message)

    def start(self) -> "EmulatedCluster":
        """Create namespaces, links and shaping, verify the link rate; tear down on failure."""
        if self._started:
            return self
        if self._torn_down:
            raise ClusterError("an EmulatedCluster cannot be restarted after teardown")
        reason = static_requirements()
        if reason:
            raise ClusterUnavailable(reason)
        self._tools, _ = tool_paths()
        self._started = True
        # Handlers and atexit go in first, so an interrupt during setup still cleans up.
        self._install_signal_handlers()
        atexit.register(self.teardown)
        try:
            cleanup_stale(self._log)
            self.prefix = claim_prefix(self._requested_prefix)
            self._tmpdir = tempfile.mkdtemp(prefix=f"aiak_cluster_{self.prefix}_")
            self._log(f"{self.prefix}: creating {self.nodes} node(s) x {self.ranks_per_node} "
                      f"rank(s), "
                      f"link {self.rate_gbit:g} Gbit/s (tbf burst "
                      f"{self.burst_bytes} B)")
            self._create_network()
            self._write_agent()
            self._check_qdiscs()
            if self.nodes >= 2 and self.verify != "off":
                self._verify_rate()
            self.env = self._build_env()
        except BaseException:
            self.teardown()
            raise
        return self

    def _ip(self, *args: str) -> None:
        self._checked([self._tools["ip"], *args])

    def _checked(self, args: Sequence[str], timeout: float = 15) -> str:
        r = run_quiet(args, timeout=timeout)
        if r.returncode != 0:
            raise ClusterError(f"'{shlex.join(args)}' failed (exit {r.returncode}): "
                               f"{r.stderr.strip()}")
        return r.stdout

    def _disable_ipv6(self, netns: str) -> None:
        # In our own namespaces only: keeps IPv6 link-local addresses (which MPI netmods may
        # pick), DAD and router solicitations off the emulated links.
        self._checked([self._tools["ip"], "netns", "exec", netns, "sh", "-c",
                       "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                       "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"])

    def _tbf(self, iface: str, netns: str) -> None:
        self._checked([self._tools["tc"], "-n", netns,
                       "qdisc", "replace", "dev", iface, "root", "tbf",
                       "rate", tc_rate(self.rate_gbit),
                       "burst", str(self.burst_bytes),
                       "latency", "50ms"])

    def _create_network(self) -> None:
        # The bridge lives in a namespace of its own (the "switch"), not in the root
        # namespace: with br_netfilter loaded (bridge-nf-call-iptables=1, as on this VM)
        # bridged IPv4 passes the root namespace's netfilter hooks, and there the TCP SYNs
        # between nodes were silently dropped while ARP passed (likely the same reason the
        # root namespace cannot connect into the namespaces).  A fresh namespace has no
        # rules, and the root namespace then holds no interface of ours at all.
        sw, br = self.switch_namespace, self.bridge
        self._ip("netns", "add", sw)
        self._disable_ipv6(sw)
        self._ip("-n", sw, "link", "add", br, "type", "bridge")
        self._ip("-n", sw, "link", "set", br, "up")
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            veth = self._veth(i)
            self._ip("netns", "add", ns)
            self._disable_ipv6(ns)
            # Created in the switch namespace with the peer put straight into the node
            # namespace, so the shared node-side name "aiak0" never exists where parallel
            # runs could collide.
            self._ip("-n", sw, "link", "add", veth, "type", "veth", "peer", "name", IFACE_NAME,
                     "netns", ns)
            self._ip("-n", sw, "link", "set", veth, "master", br)
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE_NAME)
            # tbf shapes egress only: the node end caps what the node sends, the switch end
            # what it receives.
            self._tbf(IFACE_NAME, ns)
            self._tbf(veth, sw)
            self._ip("-n", ns, "link", "set", IFACE_NAME, "up")
            self._ip("-n", sw, "link", "set", veth, "up")

    def _write_agent(self) -> None:
        assert self._tmpdir is not None
        mapping = {}
        for addr, ns, name in zip(self.addresses, self.namespaces, self.node_names):
            mapping[addr] = (ns, name)
            mapping[name] = (ns, name)  # also accept node names, for hand-written host lists
        config = os.path.join(self._tmpdir, "launch_agent.json")
        launch_agent.write_config(config, mapping, ip=self._tools["ip"],
                                  unshare=self._tools["unshare"],
                                  hostname=self._tools["hostname"])
        # Hydra takes one executable path for -launcher-exec, so a one-line wrapper binds
        # this interpreter, the agent and this run's configuration together.
        path = os.path.join(self._tmpdir, "launch_agent")
        with open(path, "w") as f:
            f.write("#!/bin/sh\nexec " + shlex.join(
                [os.path.realpath(sys.executable), "-I", _AGENT_PROGRAM, config]) + ' "$@"\n')
        os.chmod(path, 0o755)
        # Hydra's HYDRA_HOST_FILE format: one "host:slots" per line.
        with open(os.path.join(self._tmpdir, "hostfile"), "w") as f:
            f.writelines(f"{h}:{self.ranks_per_node}\n" for h in self.hosts)
        self._agent = path

    def _check_qdiscs(self) -> None:
        """Read back every tbf we set: a silently missing qdisc would mean an unshaped link."""
        for i, ns in enumerate(self.namespaces):
            for netns, dev in ((ns, IFACE_NAME), (self.switch_namespace, self._veth(i))):
                cmd = [self._tools["tc"]] + (["-n", netns] if netns else []) + [
                    "qdisc", "show", "dev", dev]
                out = self._checked(cmd)
                m = re.search(r"qdisc tbf \S+ root .*?rate (\S+)", out)
                if not m:
                    raise ClusterError(f"no tbf qdisc on {dev} ({netns or 'root ns'}): {out!r}")
                got = parse_rate(m.group(1))
                if abs(got / self.rate_gbit - 1) > 0.01:
                    raise ClusterError(f"tbf on {dev} has rate {m.group(1)}, "
                                       f"expected {self.rate_gbit:g} Gbit/s")

    def measure_link(self, src: int = 0, dst: int = 1, seconds: float | None = None
                     ) -> dict[str, float]:
        """Measure one TCP stream from node ``src`` to node ``dst``; returns a report dict.

        Bounded in time (``seconds`` of sending, default ``measure_seconds``) and in size (3x
        what the nominal rate could carry in that time), so it cannot run away.
        """
        seconds = self.measure_seconds if seconds is None else seconds
        ip = self._tools["ip"]
        py = os.path.realpath(sys.executable)
        cap = int(self.rate_gbit * 1e9 / 8 * seconds * 3) + (16 << 20)
        # Skip the first bytes: the tbf bucket and TCP slow start distort the start.
        warm = self.burst_bytes + (1 << 20)
        limit = seconds + 15
        sink = subprocess.Popen(
            [ip, "netns", "exec", self.namespaces[dst], py, "-I", _LINK_RATE_PROGRAM, "sink",
             self.addresses[dst], str(LINK_RATE_PORT), str(limit), str(warm)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([sink.stdout], [], [], 15)
            if not ready or sink.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise ClusterError(f"link-rate receiver did not start: {sink.stderr.read()}"
                                   if sink.poll() is not None else
                                   "link-rate receiver did not start in 15 s")
            src_proc = run_quiet(
                [ip, "netns", "exec", self.namespaces[src], py, "-I", _LINK_RATE_PROGRAM,
                 "source", self.addresses[dst], str(LINK_RATE_PORT), str(seconds), str(cap)],
                timeout=limit + 5)
            if src_proc.returncode != 0:
                raise ClusterError(f"link-rate sender failed (node {src} -> node {dst}): "
                                   f"{src_proc.stderr.strip()}")
            out, err = sink.communicate(timeout=limit)
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
        try:
            report = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise ClusterError(f"link-rate receiver failed: {err.strip()}") from None
        if report["seconds"] <= 0.05:
            raise ClusterError(f"link-rate run too short to measure: {report}")
        gbit = report["bytes"] * 8 / report["seconds"] / 1e9
        return {"src": src, "dst": dst, "bytes": report["bytes"], "seconds": report["seconds"],
                "gbit": gbit, "nominal_gbit": self.rate_gbit}

    def _verify_rate(self) -> None:
        report = self.measure_link(0, 1)
        self.link_report = report
        self.measured_gbit = float(report["gbit"])
        deviation = self.measured_gbit / self.rate_gbit - 1
        self._log(f"{self.prefix}: measured link {self.measured_gbit:.3f} Gbit/s "
                  f"(TCP goodput node0->node1, {report['bytes'] / 1e6:.0f} MB in "
                  f"{report['seconds']:.2f} s; nominal {self.rate_gbit:g}, {deviation:+.1%})")
        if abs(deviation) > self.tolerance:
            why = ("the CPU is probably too busy to drive the link" if deviation < 0 else
                   "the shaping is not effective")
            message = (f"measured cross-node rate {self.measured_gbit:.3f} Gbit/s is "
                       f"{deviation:+.1%} off the requested {self.rate_gbit:g} Gbit/s "
                       f"(tolerance {self.tolerance:.0%}): {why}, so figures from this "
                       f"cluster would be wrong")
            if self.verify == "require":
                raise LinkRateMismatch(message)
            banner = "!" * 78
            self._log(f"{banner}\nWARNING: {message}\n{banner}")
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _build_env(self) -> dict[str, str]:
        assert self._agent is not None and self._tmpdir is not None
        env = {
            "AIAK_CLUSTER_HOSTS": self.host_spec,
            "AIAK_CLUSTER_LAUNCHER_EXEC": self._agent,
            "AIAK_CLUSTER_IFACE": IFACE_NAME,
            "AIAK_CLUSTER_NODES": str(self.nodes),
            "AIAK_CLUSTER_RANKS_PER_NODE": str(self.ranks_per_node),
            "AIAK_CLUSTER_LINK_GBIT": (f"{self.measured_gbit:.4f}" if self.measured_gbit
                                       is not None else f"{self.rate_gbit:g}"),
            "AIAK_CLUSTER_LINK_MEASURED": "1" if self.measured_gbit is not None else "0",
            "AIAK_CLUSTER_NOMINAL_GBIT": f"{self.rate_gbit:g}",
            "AIAK_CLUSTER_NODE_NAMES": ",".join(self.node_names),
            "AIAK_CLUSTER_PREFIX": str(self.prefix),
        }
        mpiexec = find_mpiexec()
        if mpiexec:
            env["AIAK_CLUSTER_MPIEXEC"] = mpiexec
        env.update(self.mpi_env)
        if self.hydra_env:
            # Defaults for a plain `mpiexec` (explicit command-line options still win).
            env.update({
                "HYDRA_LAUNCHER": "ssh",
                "HYDRA_LAUNCHER_EXEC": self._agent,
                "HYDRA_IFACE": IFACE_NAME,
                "HYDRA_HOST_FILE": os.path.join(self._tmpdir, "hostfile"),
            })
        return env

    # -- running commands -------------------------------------------------------------------

    def mpiexec_args(self, nranks: int | None = None) -> list[str]:
        """Plain ``mpiexec`` arguments that place ranks on this cluster (see module function)."""
        return mpiexec_args(nranks, env=self.env)

    def run(
        self,
        cmd: Sequence[str] | str,
        env: Mapping[str, str | None] | None = None,
        timeout: float | None = None,
        *,
        node: int = 0,
        check: bool = False,
        reap: bool = True,
        input: str | bytes | None = None,
        **popen_kwargs: object,
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` in node ``node``'s namespace with that node's hostname.

        ``cmd`` is an argv list, or a string run through ``sh -c``.  The environment is this
        process's, plus :attr:`env`, plus ``env`` (a value of None unsets a variable).
        ``input``, ``check`` and ``capture_output`` work as in ``subprocess.run``; other
        ``popen_kwargs`` (``text``, ``cwd``, ``stdout``...) go to ``subprocess.Popen``.
        On timeout the command's process group and every process in the namespaces are
        killed, then ``subprocess.TimeoutExpired`` is raised.  With ``reap`` (default),
        processes the command left behind in the namespaces (e.g. orphaned ranks of a failed
        job) are killed afterwards, so they cannot skew the next measurement.
        """
        if not self._started or self._torn_down or self.prefix is None:
            raise ClusterError("cluster is not running (use it as a context manager)")
        if not 0 <= node < self.nodes:
            raise ValueError(f"node must be in 0..{self.nodes - 1}")
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise ValueError("empty command")
        full_env = dict(os.environ)
        full_env.update(self.env)
        for key, value in (env or {}).items():
            if value is None:  # None removes a variable, e.g. one of MPI_TRANSPORT_ENV
                full_env.pop(key, None)
            else:
                full_env[key] = value
        capture = bool(popen_kwargs.pop("capture_output", False))
        if capture:
            popen_kwargs.setdefault("stdout", subprocess.PIPE)
            popen_kwargs.setdefault("stderr", subprocess.PIPE)
        if input is not None:
            popen_kwargs["stdin"] = subprocess.PIPE
        wrapped = [self._tools["ip"], "netns", "exec", self.namespaces[node],
                   self._tools["unshare"], "--uts", "sh", "-c", _HOSTNAME_EXEC, "aiak-node",
                   self.node_names[node], self._tools["hostname"], *argv]
        # A new session, so the whole job can be signalled at once and a terminal Ctrl-C
        # reaches only this process, which then stops the job and tears down in order.
        proc = subprocess.Popen(wrapped, env=full_env, start_new_session=True,
                                **popen_kwargs)  # type: ignore[call-overload]
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except BaseException:  # timeout, Ctrl-C, SIGTERM: stop the job before propagating
            self._stop_job(proc)
            raise
        finally:
            if reap:
                kill_netns_processes(self.namespaces, keep=self._tool_pids)
        result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def _stop_job(self, proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        kill_netns_processes(self.namespaces, grace=1.0, keep=self._tool_pids)
        # Drain pipes so no fd is left dangling (communicate after kill).
        try:
            proc.communicate(timeout=5)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            pass

    # -- teardown and signals ---------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._prev_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Turn the signal into an exception: `with` blocks and `finally` clauses then run,
        # which is where the teardown happens.
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def teardown(self) -> None:
        """Kill processes in the namespaces and remove every resource of this run. Idempotent."""
        with self._lock:
            if self._torn_down:
                return
            self._torn_down = True
        in_main = threading.current_thread() is threading.main_thread()
        blocked: dict[int, object] = {}
        if in_main:
            # A second Ctrl-C must not abort the cleanup half-way.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                blocked[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            if self.prefix is not None:
                try:
                    self.clear_impairments()  # stops the jitter threads and their tc's
                except (ClusterError, OSError, subprocess.SubprocessError):
                    pass
                left = destroy(self.prefix, self._log)
                if self._tmpdir:
                    shutil.rmtree(self._tmpdir, ignore_errors=True)
                if not left:
                    release_prefix(self.prefix)  # keep the lock on leftovers: never reused
                self._log(f"{self.prefix}: torn down" + (f" (left: {left})" if left else ""))
        finally:
            try:
                atexit.unregister(self.teardown)
            except Exception:
                pass
            if in_main:
                for sig, prev in blocked.items():
                    restore = self._prev_handlers.get(sig, prev)
                    signal.signal(sig, restore if restore is not None else signal.SIG_DFL)
