"""``aiakrun``: horovodrun-compatible launcher (console script ``aiakrun = ...launch:main``).

The runner's entry point, above its four subpackages: it parses the flags (``cli/``), hands
``--advise``, elastic and ``--gloo`` jobs to their mode (``modes/``) and runs an MPI job
itself.  Flow of an MPI job: parse flags -> pick hosts and place ranks -> compute the ranks'
environment -> detect the MPI flavour -> build the launcher command (pure, in
:mod:`~aiak_training.runner.modes.mpi_run`) -> run it under supervision
(:mod:`~aiak_training.runner.guard.supervise`), with every rank wrapped by
:mod:`~aiak_training.runner.guard.task_wrapper`.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import stat
import sys
import tempfile
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from aiak_training.common.env import env_bool
from aiak_training.common.job.records import FAILURE_DIR_ENV
from aiak_training.runner.cli.args import (ignored_flags, network_interfaces, parse_args,
                                           unsupported_flags)
from aiak_training.runner.cli.env_map import exportable_names, launcher_env
from aiak_training.runner.cli.hosts import assign_slots, is_local_host, used_hosts
# UsageError is part of this module's interface (what run() reports as a usage problem).
from aiak_training.runner.cli.rank_setup import (CLUSTER_IFACE_ENV,  # noqa: F401
                                                 CLUSTER_LAUNCHER_ENV, VIRTUAL_HOSTS_ENV,
                                                 UsageError, check_hosts, hosts_source,
                                                 rank_command, rank_vars, resolve_hosts, warn)
from aiak_training.runner.cli.stdin_program import launcher_stdin, stdin_program_env
from aiak_training.runner.guard.launch_guard import finish_result, start_guards
from aiak_training.runner.modes.mpi_flavour import (Flavour, MpiLauncher, MpiNotFoundError,
                                                    detect_launcher)
from aiak_training.runner.modes.mpi_run import LaunchSpec, build_mpi_command
from aiak_training.runner.guard.start_watch import watch_start
from aiak_training.runner.guard.supervise import report, run_job
from aiak_training.runner.guard.task_wrapper import OUTPUT_DIR_ENV

def _ssh_agent(run_dir: str, port: Optional[int], identity: Optional[str]) -> str:
    """Script hydra can use as ``-launcher-exec`` to pass ssh options it has no flag for."""
    opts = []
    if port:
        opts += ["-p", str(port)]
    if identity:
        opts += ["-i", identity]
    path = os.path.join(run_dir, "ssh")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"#!/bin/sh\nexec ssh {shlex.join(opts)} \"$@\"\n")
    os.chmod(path, stat.S_IRWXU)
    return path


def prepare(args: argparse.Namespace, environ: Mapping[str, str], launcher: MpiLauncher,
            run_dir: str, stdin: Optional[IO[bytes]] = None
            ) -> Tuple[LaunchSpec, Dict[str, str]]:
    """Work out the launch: returns ``(LaunchSpec, launcher environment)``.

    Side effects are limited to ``run_dir`` (the ssh agent script for MPICH, if needed; the
    program of a ``python -`` job, read from ``stdin``, default aiakrun's, see
    :mod:`stdin_program`).
    """
    virtual = args.virtual_hosts or env_bool(VIRTUAL_HOSTS_ENV, environ=environ)
    cluster_exec = environ.get(CLUSTER_LAUNCHER_ENV) or None
    cluster_hook = bool(cluster_exec) and launcher.flavour is Flavour.MPICH and not virtual
    if cluster_exec and not cluster_hook:
        warn(f"{CLUSTER_LAUNCHER_ENV} is ignored "
              + ("with --virtual-hosts" if virtual else
                 f"(the emulated cluster needs MPICH; found {launcher.flavour.value})"))

    hosts = resolve_hosts(args, environ, cluster_hook)
    slots = assign_slots(hosts, args.num_proc)
    placed = used_hosts(slots)

    set_vars = rank_vars(args, environ, virtual)
    all_local = virtual or all(is_local_host(h.name) for h in placed)
    internal = {FAILURE_DIR_ENV: os.path.join(run_dir, "failures")}
    os.makedirs(internal[FAILURE_DIR_ENV], exist_ok=True)
    if args.output_filename:
        internal[OUTPUT_DIR_ENV] = os.path.abspath(args.output_filename)
    internal.update(stdin_program_env(args.command, args.num_proc, all_local, run_dir,
                                      launcher_stdin() if stdin is None else stdin))
    env = launcher_env(environ, {**set_vars, **internal})

    cpus = os.cpu_count() or 1
    ssh_exec = None
    if (launcher.flavour is Flavour.MPICH and not cluster_hook
            and (args.ssh_port or args.ssh_identity_file)):
        ssh_exec = _ssh_agent(run_dir, args.ssh_port, args.ssh_identity_file)
    spec = LaunchSpec(
        launcher=launcher.path,
        flavour=launcher.flavour,
        num_proc=args.num_proc,
        hosts=placed,
        command=rank_command(args.command),
        set_env=set_vars,
        export_names=exportable_names(env) if launcher.flavour in (
            Flavour.OPENMPI, Flavour.SPECTRUM) else (),
        virtual_hosts=virtual,
        launcher_major_version=launcher.major_version,
        run_as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
        # Open MPI refuses to start more ranks than cores on a host unless told to.
        oversubscribe=all_local and args.num_proc > cpus,
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        ssh_exec=ssh_exec,
        cluster_launcher_exec=cluster_exec if cluster_hook else None,
        iface=(environ.get(CLUSTER_IFACE_ENV) or None) if cluster_hook else None,
        nics=network_interfaces(args),
        binding_args=shlex.split(args.binding_args) if args.binding_args else None,
        extra_mpi_args=shlex.split(args.mpi_args) if args.mpi_args else (),
        tcp=args.tcp,
        hosts_source=hosts_source(args),
    )
    return spec, env


def proxy_hosts(spec: LaunchSpec, launcher: MpiLauncher) -> List[Tuple[str, List[int]]]:
    """For MPICH's hydra: each host in launch order with its ranks, so that aiakrun can name a
    host that vanished as a whole (see supervise.ProxyWatch).  Empty for other MPIs and for
    virtual hosts, where one local proxy runs everything."""
    if launcher.flavour is not Flavour.MPICH or spec.virtual_hosts:
        return []
    out: List[Tuple[str, List[int]]] = []
    first = 0
    for host in spec.hosts:
        out.append((host.name, list(range(first, first + host.slots))))
        first += host.slots
    return out


def rank_hosts(spec: LaunchSpec) -> Dict[int, str]:
    """Each rank's host as the summary names it (this machine's name for a local host)."""
    here = socket.gethostname()
    out: Dict[int, str] = {}
    for host in spec.hosts:
        name = host.name if spec.virtual_hosts or not is_local_host(host.name) else here
        for _ in range(host.slots):
            out[len(out)] = name
    return out


def _version_text() -> str:
    from aiak_training.runner.cli.check_build import HOROVOD_VERSION, aiak_version
    return f"aiakrun (aiak-training) {aiak_version()}, compatible with Horovod {HOROVOD_VERSION}"


def run(argv: Optional[Sequence[str]] = None) -> int:
    """aiakrun's logic; returns the exit status instead of exiting."""
    args = parse_args(argv)
    if args.version:
        print(_version_text())
        return 0
    if args.check_build:
        from aiak_training.runner.cli.check_build import check_build_text
        print(check_build_text())
        return 0
    problems = unsupported_flags(args)
    if problems:
        for p in problems:
            print(f"aiakrun: error: {p}", file=sys.stderr)
        return 2
    for flag in ignored_flags(args):
        warn(f"{flag} is not supported by aiak-training and is ignored")
    if not args.command:
        print("aiakrun: error: no command given (e.g. aiakrun -np 2 python train.py)",
              file=sys.stderr)
        return 2
    if args.advise or args.what_if is not None:  # measure and predict (runner/modes/advise.py)
        from aiak_training.runner.modes.advise import run_advise
        return run_advise(args, argv)
    from aiak_training.runner.modes.elastic.launch import elastic_requested, run_elastic
    if elastic_requested(args):  # --host-discovery-script / --min-np (runner/modes/elastic/)
        return run_elastic(args, os.environ)
    if args.num_proc is None:
        print("aiakrun: error: -np/--num-proc is required", file=sys.stderr)
        return 2

    if args.use_gloo:  # no MPI at all: aiakrun starts the ranks itself (runner/modes/gloo_run.py)
        from aiak_training.runner.modes.gloo_run import run_gloo
        return run_gloo(args, os.environ)
    run_dir = tempfile.mkdtemp(prefix="aiakrun.")
    try:
        try:
            launcher = detect_launcher(os.environ)
            spec, env = prepare(args, os.environ, launcher, run_dir)
            check_hosts(spec.hosts, args, spec.virtual_hosts, bool(spec.cluster_launcher_exec))
            build_mpi_command(spec)  # refuses a bad layout before a port is opened
            # Liveness port and output reader (runner/guard/launch_guard.py).
            spec, liveness, output = start_guards(spec, env, verbose=bool(args.verbose))
            cmd = build_mpi_command(spec)
        except MpiNotFoundError as exc:
            print(f"aiakrun: error: {exc}", file=sys.stderr)
            return 1
        except (ValueError, OSError) as exc:  # bad -H/--hostfile, -np too large, ...
            print(f"aiakrun: error: {exc}", file=sys.stderr)
            return 2
        if args.verbose:
            print(f"aiakrun: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        try:
            result = run_job(cmd, env, env[FAILURE_DIR_ENV],
                             proxy_hosts=proxy_hosts(spec, launcher), output=output,
                             start=watch_start(env, env[FAILURE_DIR_ENV], rank_hosts(spec),
                                               "MPI_Init"))
        except OSError as exc:  # the launcher vanished between detection and start
            print(f"aiakrun: error: could not run {launcher.path}: {exc}", file=sys.stderr)
            return 1
        finally:
            liveness.close()
        finish_result(result, output, spec, env[FAILURE_DIR_ENV])
        report(result, launcher.path)
        return result.exit_code
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point."""
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
