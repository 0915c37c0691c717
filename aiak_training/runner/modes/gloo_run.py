"""``aiakrun --gloo``: a job with no MPI at all.

aiakrun plays both parts MPI's launcher plays in the default mode, reusing everything else:

* :func:`run_gloo` (in aiakrun) places the ranks exactly as the MPI mode does (``-H``,
  ``--hostfile``, the emulated cluster's hosts), computes their environment with the same
  code, and runs a *Gloo launcher* process under :func:`supervise.run_job` — so Ctrl-C
  forwarding, failure records, the final sweep, the report and exit codes are the MPI mode's.
* The Gloo launcher (``python -m aiak_training.runner.modes.gloo_run PLAN``) is the stand-in for
  ``mpiexec``: it starts the rendezvous store (a ``TCPStore``) on this host, starts every rank
  behind the task wrapper — locally, or on a remote host through the same ssh-like command
  MPI's launcher would use (ssh, or ``$AIAK_CLUSTER_LAUNCHER_EXEC`` on the emulated cluster) —
  with its identity in Horovod's variables, prefixes each output line with ``[rank]``, and
  ends the job as hydra does: when a rank fails, the others are stopped.  A rank whose
  remote launch ended without the task wrapper reporting is recorded as lost with its host.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from aiak_training.common.host.net import interface_address, route_address
from aiak_training.common.job.records import (FAILURE_DIR_ENV, RankFailure, describe_returncode,
                                              now, write_failure)
from aiak_training.runner.cli.env_map import is_exportable, launcher_env
from aiak_training.runner.cli.hosts import (HostSlots, assign_slots, is_local_host, ssh_failure,
                                            unreachable, used_hosts)
from aiak_training.runner.guard.task_wrapper import OUTPUT_DIR_ENV
from aiak_training.runner.report.failure import shell_status
from aiak_training.runner.report.line_pump import write_all

#: Seconds the ranks get to end after a stop signal or a failed peer, before SIGKILL.
STOP_GRACE_S = 10.0
#: After a rank failed, the other ranks get this long to fail or finish by themselves (their
#: engines raise HorovodInternalError, programs print why) before they are stopped.
FAILURE_GRACE_S = 3.0


# ---- aiakrun side -------------------------------------------------------------------------------
def rendezvous_address(hosts: Sequence[HostSlots], iface: Optional[str]) -> str:
    """Where the ranks reach the store on this host: loopback for a local job, else the
    address of ``iface`` (``--network-interface`` / the emulated cluster's interface) or of the
    route to the first remote host."""
    remote = [h.name for h in hosts if not is_local_host(h.name)]
    if not remote:
        return "127.0.0.1"
    addr = interface_address(iface) if iface else None
    addr = addr or route_address(remote[0])
    if not addr:
        try:
            socket.getaddrinfo(remote[0], None)
        except (socket.gaierror, UnicodeError):
            raise ValueError(f"--gloo: host {remote[0]} does not resolve") from None
        # It resolves, but no local address routes to it: an interface must be named.
        raise ValueError(f"--gloo: cannot find this host's address towards {remote[0]} for the "
                         "rendezvous; pass --network-interface")
    return addr


def plan_job(args: argparse.Namespace, environ: Mapping[str, str], run_dir: str,
             stdin: Optional[IO[bytes]] = None) -> Tuple[Dict, Dict[str, str]]:
    """The Gloo launcher's plan (JSON-able) and aiakrun's environment for it (``stdin``:
    where a ``python -`` program is read from, default aiakrun's standard input)."""
    from aiak_training.common.env import env_bool
    from aiak_training.runner.cli.args import network_interfaces
    from aiak_training.runner.cli.rank_setup import (CLUSTER_IFACE_ENV, CLUSTER_LAUNCHER_ENV,
                                                     VIRTUAL_HOSTS_ENV, check_hosts, hosts_source,
                                                     rank_command, rank_vars, resolve_hosts)
    from aiak_training.runner.cli.stdin_program import launcher_stdin, stdin_program_env
    virtual = args.virtual_hosts or env_bool(VIRTUAL_HOSTS_ENV, environ=environ)
    cluster_exec = environ.get(CLUSTER_LAUNCHER_ENV) or None
    if virtual:
        cluster_exec = None
    placement = assign_slots(resolve_hosts(args, environ, bool(cluster_exec)), args.num_proc)
    hosts = used_hosts(placement)
    check_hosts(hosts, args, virtual, bool(cluster_exec))
    set_vars = rank_vars(args, environ, virtual)
    nics = network_interfaces(args)
    iface = nics[0] if nics else (environ.get(CLUSTER_IFACE_ENV) if cluster_exec else None)
    if iface:
        set_vars.setdefault("HOROVOD_GLOO_IFACE", iface)
    failure_dir = os.path.join(run_dir, "failures")
    os.makedirs(failure_dir, exist_ok=True)
    internal = {FAILURE_DIR_ENV: failure_dir, "HOROVOD_CONTROLLER": "gloo"}
    if args.output_filename:
        internal[OUTPUT_DIR_ENV] = os.path.abspath(args.output_filename)
    all_local = virtual or all(is_local_host(h.name) for h in hosts)
    internal.update(stdin_program_env(args.command, args.num_proc, all_local, run_dir,
                                      launcher_stdin() if stdin is None else stdin))
    env = launcher_env(environ, {**set_vars, **internal})
    remote_exec: List[str] = []
    if cluster_exec:
        remote_exec = [cluster_exec]
    else:
        remote_exec = ["ssh", "-o", "BatchMode=yes"]
        if args.ssh_port:
            remote_exec += ["-p", str(args.ssh_port)]
        if args.ssh_identity_file:
            remote_exec += ["-i", args.ssh_identity_file]
    ranks = [{"host": r.hostname, "local": virtual or is_local_host(r.hostname),
              "env": r.horovod_env()} for r in placement]
    plan = {"ranks": ranks, "command": rank_command(args.command),
            "rendezvous_addr": "127.0.0.1" if virtual else rendezvous_address(hosts, iface),
            "remote_exec": remote_exec, "cwd": os.getcwd(), "verbose": bool(args.verbose),
            "hosts_source": hosts_source(args)}
    return plan, env


def run_gloo(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """aiakrun --gloo: plan, run the Gloo launcher under supervision, report."""
    from aiak_training.runner.guard.start_watch import arrivals, watch_start
    from aiak_training.runner.guard.supervise import report, run_job
    run_dir = tempfile.mkdtemp(prefix="aiakrun.")
    try:
        try:
            plan, env = plan_job(args, environ, run_dir)
        except (ValueError, OSError) as exc:
            print(f"aiakrun: error: {exc}", file=sys.stderr)
            return 2
        plan_path = os.path.join(run_dir, "gloo_plan.json")
        with open(plan_path, "w", encoding="utf-8") as f:
            json.dump(plan, f)
        cmd = [sys.executable, "-m", "aiak_training.runner.modes.gloo_run", plan_path]
        if args.verbose:
            print(f"aiakrun: {shlex.join(cmd)} ({len(plan['ranks'])} ranks over Gloo)",
                  file=sys.stderr, flush=True)
        hosts = {i: r["host"] for i, r in enumerate(plan["ranks"])}
        result = run_job(cmd, env, env[FAILURE_DIR_ENV],
                         start=watch_start(env, env[FAILURE_DIR_ENV], hosts,
                                           "the Gloo rendezvous"))
        report(result, "the Gloo launcher")
        if result.exit_code == 0 and all(r["local"] for r in plan["ranks"]) and \
                not arrivals(env[FAILURE_DIR_ENV]):
            # Every rank ended well without ever joining the job: say so rather than pass
            # it off as a run (an empty `python -` program, a script that never calls init).
            print(f"aiakrun: warning: all {len(plan['ranks'])} ranks exited 0 without "
                  "joining the job: no rank called hvd.init(), nothing ran over Gloo",
                  file=sys.stderr, flush=True)
        return result.exit_code
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# ---- the Gloo launcher process ------------------------------------------------------------------
class _Rank:
    """One started rank: its process (the task wrapper, or the remote-launch command that runs
    it) and the threads that label its output."""

    def __init__(self, rank: int, host: str, local: bool, proc: subprocess.Popen):
        self.rank, self.host, self.local, self.proc = rank, host, local, proc
        self.reported = False  # its task wrapper printed its failure line
        self.ssh_failure: Optional[Tuple[str, str]] = None  # its remote launch's, if any
        self.threads: List[threading.Thread] = []
        self.ended_at: Optional[float] = None  # wall-clock end, stamped by a waiter thread
        self.handled = False
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        # Its own thread, so the end is stamped when it happens: the failure that came first
        # is the one reported, even when several ranks end within one poll of the launcher.
        self.proc.wait()
        self.ended_at = now()

    def pump(self, stream, console: int) -> None:
        prefix = f"[{self.rank}] ".encode()
        marker = f"aiakrun: rank {self.rank} ".encode()
        for line in iter(stream.readline, b""):
            if line.startswith(marker):
                self.reported = True
            elif not self.local and self.ssh_failure is None:
                self.ssh_failure = ssh_failure(line)
            try:
                write_all(console, prefix + (line if line.endswith(b"\n") else line + b"\n"))
            except OSError:
                pass
        stream.close()


def remote_command(rank_env: Mapping[str, str], env: Mapping[str, str], cwd: str,
                    command: Sequence[str]) -> str:
    """The shell line run on a remote host: same directory, the job's environment, exec'd so
    that signals reach the task wrapper."""
    names = sorted(k for k in env if is_exportable(k) and k not in rank_env)
    assigns = [f"{k}={shlex.quote(env[k])}" for k in names]
    assigns += [f"{k}={shlex.quote(v)}" for k, v in rank_env.items()]
    return f"cd {shlex.quote(cwd)} && exec env {' '.join(assigns)} {shlex.join(command)}"


def _lost_record(r: _Rank, returncode: int, host_ranks: Sequence[int],
                 source: str = "") -> RankFailure:
    """The failure record of a rank that ended without its task wrapper reporting."""
    if len(host_ranks) > 1:
        who = f"ranks {host_ranks[0]}-{host_ranks[-1]}" if list(host_ranks) == list(
            range(host_ranks[0], host_ranks[-1] + 1)) else \
            "ranks " + ", ".join(str(x) for x in host_ranks)
    else:
        who = f"rank {host_ranks[0]}"
    if r.ssh_failure is not None:
        return RankFailure(r.rank, r.host, returncode, r.ended_at or now(),
                           detail="could not start: " + unreachable(*r.ssh_failure, source))
    where = "remote launch" if not r.local else "process"
    return RankFailure(r.rank, r.host, returncode, r.ended_at or now(),
                       detail=f"was lost: host {r.host} ({who}): its {where} ended with "
                              f"{describe_returncode(returncode)} before the rank could report "
                              "(the host, or the job's processes on it, went away)")


def launcher_main(plan_path: str) -> int:
    """Start the store and the ranks, wait, stop the rest when one fails; the exit status is
    the first failed rank's (0 when all succeed)."""
    from aiak_training.runtime.transport.gloo import start_rendezvous_server
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    stop: List[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    # The store's socket listens before the ranks start, and torch (imported for the store)
    # loads while they start: a short job does not wait for that import first.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(512)
    port = listener.getsockname()[1]
    env = dict(os.environ)
    common = {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_GLOO_RENDEZVOUS_ADDR":
              plan["rendezvous_addr"], "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)}
    ranks: List[_Rank] = []
    by_host: Dict[str, List[int]] = {}
    for i, entry in enumerate(plan["ranks"]):
        rank_env = {**common, **entry["env"]}
        by_host.setdefault(entry["host"], []).append(i)
        if entry["local"]:
            argv, child_env = plan["command"], {**env, **rank_env}
        else:
            argv = plan["remote_exec"] + [entry["host"], remote_command(
                rank_env, env, plan["cwd"], plan["command"])]
            child_env = env
        # Local wrappers share this stdin and pass it on to rank 0 only (as MPI launchers
        # do; runner/cli/stdin_program.py); a remote launch gets none.
        proc = subprocess.Popen(argv, env=child_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE,
                                stdin=None if entry["local"] else subprocess.DEVNULL)
        r = _Rank(i, entry["host"], entry["local"], proc)
        for stream, console in ((proc.stdout, 1), (proc.stderr, 2)):
            t = threading.Thread(target=r.pump, args=(stream, console), daemon=True)
            t.start()
            r.threads.append(t)
        ranks.append(r)
    # The store takes the socket over (it closes it when it ends).
    store, _ = start_rendezvous_server("0.0.0.0", port, listen_fd=listener.detach())
    failure_dir = env.get(FAILURE_DIR_ENV, "")
    failures: List[Tuple[float, int]] = []  # (end time, return code) of failed ranks
    failed_at = stop_at = killed_at = None
    forwarded = False
    while True:
        now_s = time.monotonic()
        for r in ranks:
            if r.ended_at is None or r.handled:
                continue
            r.handled = True
            code = r.proc.returncode
            if code == 0 or stop or forwarded:  # ended by our own stop: not a failure
                continue
            failures.append((r.ended_at, code))
            failed_at = failed_at if failed_at is not None else now_s
            for t in r.threads:
                t.join(timeout=1.0)
            if not r.reported:
                # Nothing of the rank said why (killed with its wrapper, or its host went
                # away): record it as lost, with its host, for aiakrun's report.
                write_failure(failure_dir, _lost_record(r, code, by_host[r.host],
                                                        plan.get("hosts_source", "")))
        running = [r for r in ranks if r.ended_at is None]
        if not running:
            break
        if stop and not forwarded:
            forwarded, stop_at = True, now_s
            for r in running:
                _signal(r.proc, stop[0])
        deadline = min(failed_at + FAILURE_GRACE_S if failed_at is not None else float("inf"),
                       stop_at + STOP_GRACE_S if stop_at is not None else float("inf"))
        if failed_at is not None and not forwarded and now_s >= deadline:
            forwarded, stop_at = True, now_s
            for r in running:
                _signal(r.proc, signal.SIGTERM)
        elif forwarded and killed_at is None and now_s >= (stop_at or now_s) + STOP_GRACE_S:
            killed_at = now_s
            for r in running:
                _signal(r.proc, signal.SIGKILL)
        time.sleep(0.05)
    for r in ranks:
        for t in r.threads:
            t.join(timeout=2.0)
    del store
    if failures:
        return shell_status(min(failures)[1]) or 1
    if stop:
        return 128 + stop[0]
    return 0


def _signal(proc: subprocess.Popen, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(launcher_main(sys.argv[1]))
