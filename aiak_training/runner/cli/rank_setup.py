"""What every launch mode (MPI, ``--gloo``, elastic) gives each rank: the hosts it may run on,
the command it runs (the user's behind the task wrapper) and the variables aiakrun sets for it.

Kept apart from :mod:`aiak_training.runner.launch` so that the Gloo and elastic launchers can use
it without importing the MPI launcher that dispatches to them.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Mapping, Sequence

from aiak_training.compat import COMPAT_ENV, RealHorovodError, compat_pythonpath, compat_requested
from aiak_training.compat.keras2 import keras2_vars
from aiak_training.runner.cli.env_map import flag_env, parse_env_assignments
from aiak_training.runner.cli.hosts import (HostSlots, check_names_resolve, parse_hostfile,
                                            parse_hosts)

WRAPPER_MODULE = "aiak_training.runner.guard.task_wrapper"
VIRTUAL_HOSTS_ENV = "AIAK_VIRTUAL_HOSTS"
CLUSTER_LAUNCHER_ENV = "AIAK_CLUSTER_LAUNCHER_EXEC"
CLUSTER_IFACE_ENV = "AIAK_CLUSTER_IFACE"
CLUSTER_HOSTS_ENV = "AIAK_CLUSTER_HOSTS"


class UsageError(ValueError):
    """A problem with the command line or its inputs (exit status 2)."""


def warn(message: str) -> None:
    print(f"aiakrun: warning: {message}", file=sys.stderr)


def resolve_hosts(args: argparse.Namespace, environ: Mapping[str, str],
                  cluster_hook: bool) -> List[HostSlots]:
    """-H, else --hostfile, else $AIAK_CLUSTER_HOSTS (emulated cluster), else localhost:NP."""
    if args.hosts:
        return parse_hosts(args.hosts)
    if args.hostfile:
        return parse_hostfile(args.hostfile)
    if cluster_hook and environ.get(CLUSTER_HOSTS_ENV):
        return parse_hosts(environ[CLUSTER_HOSTS_ENV])
    return [HostSlots("localhost", args.num_proc)]


def hosts_source(args: argparse.Namespace) -> str:
    """The flag that listed the hosts :func:`resolve_hosts` returns, as a message names it."""
    if args.hosts:
        return "-H"
    if args.hostfile:
        return f"--hostfile {args.hostfile}"
    return ""


def check_hosts(hosts: Sequence[HostSlots], args: argparse.Namespace, virtual: bool,
                cluster_exec: bool) -> None:
    """Refuse a host list whose names do not resolve (not for virtual hosts, nor on the
    emulated cluster, whose launcher reaches its nodes by name without DNS)."""
    source = hosts_source(args)
    if source and not virtual and not cluster_exec:
        check_names_resolve(hosts, source)


def rank_command(command: Sequence[str], python: str = sys.executable) -> List[str]:
    """What MPI starts on each rank: the user's command behind the task wrapper."""
    return [python, "-m", WRAPPER_MODULE, "--", *command]


def rank_vars(args: argparse.Namespace, environ: Mapping[str, str],
              virtual: bool) -> Dict[str, str]:
    """Variables aiakrun sets for the ranks: tunable flags, ``-x``, the compat PYTHONPATH (and
    Keras 2 for the compat switch, see :mod:`aiak_training.compat.keras2`)."""
    set_vars: Dict[str, str] = flag_env(args, environ)
    x_vars, missing = parse_env_assignments(args.env_vars, environ)
    for name in missing:
        warn(f"-x {name}: {name} is not set here; not passed")
    if virtual and "HOROVOD_HOSTNAME" in x_vars:
        raise UsageError("-x HOROVOD_HOSTNAME conflicts with --virtual-hosts, which sets it "
                         "per rank")
    set_vars.update(x_vars)
    if compat_requested(args.horovod_compat, dict(environ)):
        try:
            set_vars["PYTHONPATH"] = compat_pythonpath(set_vars.get("PYTHONPATH",
                                                                    environ.get("PYTHONPATH")))
        except RealHorovodError as exc:
            raise UsageError(f"--horovod-compat: {exc}") from exc
        set_vars[COMPAT_ENV] = "1"
        # Horovod's TensorFlow scripts are Keras 2 scripts: tf_keras where it is installed.
        set_vars.update(keras2_vars(environ, set_vars))
    return set_vars
