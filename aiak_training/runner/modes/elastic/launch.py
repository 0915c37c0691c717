"""``aiakrun`` in elastic mode: turn the command line into an :class:`ElasticDriver` run.

Elastic mode is on when ``--host-discovery-script`` or ``--min-np`` is given (as in
horovodrun).  Hosts come from the discovery script, else from ``-H``/``--hostfile`` (a
fixed list: the job still survives losing hosts down to ``--min-np``).  Workers use the Gloo
transport; the rendezvous store runs here, in aiakrun.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Mapping, Optional

from aiak_training.elastic import protocol
from aiak_training.runner.modes.elastic.discovery import DiscoveryError, HostDiscoveryScript
from aiak_training.runner.modes.elastic.driver import ElasticDriver, ElasticSettings
from aiak_training.runner.modes.elastic.function_job import worker_env
from aiak_training.runner.modes.elastic.hosts import Slot
from aiak_training.runner.modes.elastic.spawn import WorkerProcess, host_is_local, worker_argv


def elastic_requested(args: argparse.Namespace) -> bool:
    """Whether the command line asks for elastic mode (horovodrun's rule)."""
    return bool(getattr(args, "elastic_host_discovery_script", None)) or \
        getattr(args, "elastic_min_np", None) is not None


def _number(flag: str, text, kind, minimum) -> Optional[float]:
    if text is None:
        return None
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise ValueError(f"{flag}: expected {'an integer' if kind is int else 'a number'}, "
                         f"got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{flag}: must be >= {minimum}, got {text}")
    return value


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ElasticSettings:
    """Validate the elastic flags; ``ValueError`` names the bad one."""
    min_np = _number("--min-np", args.elastic_min_np, int, 1)
    max_np = _number("--max-np", args.elastic_max_np, int, 1)
    num_proc = args.num_proc
    if min_np is None:
        min_np = num_proc
    if min_np is None:
        raise ValueError("elastic mode needs -np or --min-np")
    if max_np is not None and max_np < min_np:
        raise ValueError(f"--max-np {max_np} is smaller than --min-np {min_np}")
    if num_proc is not None and num_proc < min_np:
        raise ValueError(f"-np {num_proc} is smaller than --min-np {min_np}")
    if num_proc is not None and max_np is not None and num_proc > max_np:
        raise ValueError(f"-np {num_proc} is larger than --max-np {max_np}")
    timeout = _number("--elastic-timeout", args.elastic_elastic_timeout, float, 0)
    if timeout is None:
        timeout = _number("HOROVOD_ELASTIC_TIMEOUT", environ.get(protocol.WAIT_ENV), float, 0)
    reset_limit = _number("--reset-limit", args.elastic_reset_limit, int, 0)
    cooldown = None
    if args.elastic_blacklist_cooldown_range is not None:
        low, high = (_number("--blacklist-cooldown-range", v, float, 0)
                     for v in args.elastic_blacklist_cooldown_range)
        if high < low:
            raise ValueError(f"--blacklist-cooldown-range: the maximum {high:g} is smaller "
                             f"than the minimum {low:g}")
        cooldown = (low, high)
    start = args.start_timeout or _number("HOROVOD_START_TIMEOUT",
                                          environ.get("HOROVOD_START_TIMEOUT"), float, 1)
    return ElasticSettings(num_proc=num_proc, min_np=int(min_np),
                           start_timeout=float(start or 120.0),
                           max_np=int(max_np) if max_np is not None else None,
                           elastic_timeout=protocol.DEFAULT_ELASTIC_TIMEOUT
                           if timeout is None else float(timeout),
                           reset_limit=int(reset_limit) if reset_limit is not None else None,
                           cooldown=cooldown)


def _fixed_hosts(args: argparse.Namespace, environ: Mapping[str, str], cluster: bool,
                 resolve_hosts) -> Dict[str, int]:
    if not (args.hosts or args.hostfile or (cluster and environ.get("AIAK_CLUSTER_HOSTS"))):
        if args.num_proc is None:
            raise ValueError("elastic mode needs --host-discovery-script, -H/--hostfile or -np")
    return {h.name: h.slots for h in resolve_hosts(args, environ, cluster)}


def run_elastic(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """aiakrun's elastic mode; returns the exit status.  Hosts, the rank environment and the
    rank command come from :mod:`aiak_training.runner.cli.rank_setup`, as in the other modes."""
    from aiak_training.common.env import env_bool
    from aiak_training.common.job.records import FAILURE_DIR_ENV
    from aiak_training.runner.cli import rank_setup
    from aiak_training.runner.cli.args import network_interfaces
    from aiak_training.runner.cli.env_map import launcher_env
    from aiak_training.runner.cli.hosts import HostSlots
    from aiak_training.runner.modes.gloo_run import rendezvous_address
    UsageError, rank_vars = rank_setup.UsageError, rank_setup.rank_vars
    from aiak_training.runner.guard.task_wrapper import OUTPUT_DIR_ENV
    if not args.command:
        print("aiakrun: error: no command given", file=sys.stderr)
        return 2
    try:
        settings = settings_from_args(args, environ)
        virtual = args.virtual_hosts or env_bool(rank_setup.VIRTUAL_HOSTS_ENV, environ=environ)
        cluster_exec = None if virtual else (environ.get(rank_setup.CLUSTER_LAUNCHER_ENV) or None)
        script = args.elastic_host_discovery_script
        if script:
            discovery = HostDiscoveryScript(script, _number(
                "--slots-per-host", args.elastic_slots_per_host, int, 1))
            discovery.check()
            discover = discovery.find_available_hosts_and_slots
            try:
                first = discover()
            except DiscoveryError as exc:
                print(f"aiakrun: warning: {exc}", file=sys.stderr)
                first = {}
        else:
            first = _fixed_hosts(args, environ, bool(cluster_exec), rank_setup.resolve_hosts)
            fixed = dict(first)

            def discover() -> Dict[str, int]:
                return dict(fixed)
        set_vars = rank_vars(args, environ, virtual)
        nics = network_interfaces(args)
        iface = nics[0] if nics else (environ.get(rank_setup.CLUSTER_IFACE_ENV) if cluster_exec
                                      else None)
        hosts = [HostSlots(h, n) for h, n in first.items()]
        addr = "127.0.0.1" if virtual or not hosts else rendezvous_address(hosts, iface)
    except (ValueError, DiscoveryError, UsageError) as exc:
        print(f"aiakrun: error: {exc}", file=sys.stderr)
        return 2

    from aiak_training.runtime.transport.gloo import start_rendezvous_server
    store, port = start_rendezvous_server("0.0.0.0", 0)
    run_dir = tempfile.mkdtemp(prefix="aiakrun.elastic.")
    try:
        failure_dir = os.path.join(run_dir, "failures")
        os.makedirs(failure_dir, exist_ok=True)
        internal = {FAILURE_DIR_ENV: failure_dir}
        if args.output_filename:
            internal[OUTPUT_DIR_ENV] = os.path.abspath(args.output_filename)
        env = launcher_env(environ, {**set_vars, **internal})
        remote_exec: List[str] = [cluster_exec] if cluster_exec else \
            ["ssh", "-o", "BatchMode=yes"] + (["-p", str(args.ssh_port)] if args.ssh_port
                                              else []) + \
            (["-i", args.ssh_identity_file] if args.ssh_identity_file else [])
        def spawn(wid: str, slot: Slot) -> WorkerProcess:
            host = slot[0]
            local = host_is_local(host, virtual)
            rank_env = worker_env(settings, port, wid, host, "127.0.0.1" if local and
                                  (virtual or addr == "127.0.0.1") else addr)
            rank_env["HOROVOD_GLOO_IFACE"] = set_vars.get("HOROVOD_GLOO_IFACE") or \
                ("lo" if local and virtual else (iface or ""))
            if not rank_env["HOROVOD_GLOO_IFACE"]:
                del rank_env["HOROVOD_GLOO_IFACE"]
            argv = worker_argv(rank_setup.rank_command(args.command), host, rank_env, env, local,
                               remote_exec)
            if args.verbose:
                print(f"aiakrun: elastic: starting {wid} on {host}: {' '.join(argv)}",
                      file=sys.stderr, flush=True)
            return WorkerProcess(f"{host}:{slot[1]}", argv, {**env, **rank_env})

        driver = ElasticDriver(settings, discover, spawn, store)
        result = driver.run()
        return result.exit_code
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        del store
