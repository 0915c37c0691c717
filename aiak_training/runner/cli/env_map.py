"""What environment the ranks get: flags mapped to Horovod/AIAK variables, ``-x``, exports."""
from __future__ import annotations

import argparse
import os
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from aiak_training.common.tuning import (ALLREDUCE_ALGORITHM, CYCLE_TIME, FUSED_OPTIMIZER,
                                         FUSION_THRESHOLD, HIERARCHICAL_ALLREDUCE_VARIABLE, MB,
                                         OVERLAP_UPDATE, RESPONSE_CACHE)
from aiak_training.runner.cli.args import network_interfaces

DEFAULT_START_TIMEOUT = 30
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables that describe the launching shell rather than the job (horovodrun skips the same
# kind); exporting them to remote hosts is useless or, for functions, breaks quoting.
_NOT_EXPORTED = {"OLDPWD", "_", "PS1", "PS2", "SHLVL", "HOROVOD_SECRET_KEY"}
# Per-rank identity: inheriting a stale value from the launching shell would put every rank of
# a real multi-host job on one "node" (the engine groups ranks by it), so it is only passed on
# when asked for explicitly with -x, or set per rank by --virtual-hosts.
PER_RANK_VARS = ("HOROVOD_HOSTNAME", "AIAK_VIRTUAL_HOST_MAP")


def _bool(value: bool) -> str:
    return "1" if value else "0"


def flag_env(args: argparse.Namespace, environ: Mapping[str, str]) -> Dict[str, str]:
    """Environment variables implied by the tunable flags, in a stable order.

    Only flags that were given produce a variable, so a value already exported in the user's
    shell (e.g. HOROVOD_CYCLE_TIME) still reaches the ranks unchanged.  The knobs' flags set
    the variables of the knob table (common/tuning).
    """
    env: Dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        env[FUSION_THRESHOLD.variable] = str(args.fusion_threshold_mb * MB)
    if args.cycle_time_ms is not None:
        env[CYCLE_TIME.variable] = str(args.cycle_time_ms)
    if args.cache_capacity is not None:
        env[RESPONSE_CACHE.variable] = str(args.cache_capacity)
    if args.hierarchical_allreduce is not None:
        env[HIERARCHICAL_ALLREDUCE_VARIABLE] = _bool(args.hierarchical_allreduce)
    if args.hierarchical_allgather is not None:
        env["HOROVOD_HIERARCHICAL_ALLGATHER"] = _bool(args.hierarchical_allgather)
    if args.mpi_threads_disable is not None:
        env["HOROVOD_MPI_THREADS_DISABLE"] = _bool(args.mpi_threads_disable)
    if args.timeline_filename:
        env["HOROVOD_TIMELINE"] = args.timeline_filename
    if args.timeline_mark_cycles is not None:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = _bool(args.timeline_mark_cycles)
    if args.no_stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    elif args.stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "0"
    if args.stall_check_warning_time_seconds is not None:
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(args.stall_check_warning_time_seconds)
    if args.stall_check_shutdown_time_seconds is not None:
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(args.stall_check_shutdown_time_seconds)
    if args.log_level:
        env["HOROVOD_LOG_LEVEL"] = args.log_level
    if args.log_hide_time is not None:
        env["HOROVOD_LOG_HIDE_TIME"] = _bool(args.log_hide_time)
    if args.tcp:
        env["NCCL_IB_DISABLE"] = "1"
    nics = network_interfaces(args)
    if nics:
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    env["HOROVOD_START_TIMEOUT"] = str(args.start_timeout if args.start_timeout is not None
                                       else environ.get("HOROVOD_START_TIMEOUT")
                                       or DEFAULT_START_TIMEOUT)
    env.update(_autotune_env(args))
    if args.overlap_update:
        env[OVERLAP_UPDATE.variable] = "1"
    if args.allreduce_algo:
        env[ALLREDUCE_ALGORITHM.variable] = args.allreduce_algo
    if args.fused_optimizer:
        env[FUSED_OPTIMIZER.variable] = "1"
    # Ranks' output goes through pipes; unbuffered output keeps lines from different ranks in
    # order of writing and means nothing is lost when a rank is killed.
    env["PYTHONUNBUFFERED"] = "1"
    return env


# aiakrun's autotune flags (runner/cli/args.py) -> the Horovod variable each one sets.
AUTOTUNE_VARS = (
    ("autotune_log_file", "HOROVOD_AUTOTUNE_LOG"),
    ("autotune_warmup_samples", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"),
    ("autotune_steps_per_sample", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"),
    ("autotune_bayes_opt_max_samples", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"),
    ("autotune_gaussian_process_noise", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"),
)


def _autotune_env(args: argparse.Namespace) -> Dict[str, str]:
    """The HOROVOD_AUTOTUNE* variables of the autotune flags that were given."""
    env: Dict[str, str] = {}
    if getattr(args, "autotune", None) is not None:
        env["HOROVOD_AUTOTUNE"] = _bool(args.autotune)
    for dest, name in AUTOTUNE_VARS:
        value = getattr(args, dest, None)
        if value is not None:
            env[name] = str(value)
    return env


def parse_env_assignments(items: Sequence[str], environ: Mapping[str, str]
                          ) -> Tuple[Dict[str, str], List[str]]:
    """Resolve ``-x VAR=VAL`` / ``-x VAR`` items.

    Returns the values and the names given without a value that are not set here (the caller
    warns about those).  Raises ValueError for names that are not valid variable names.
    """
    values: Dict[str, str] = {}
    missing: List[str] = []
    for item in items:
        name, sep, value = item.partition("=")
        if not _NAME_RE.match(name):
            raise ValueError(f"-x {item!r}: {name!r} is not a valid environment variable name")
        if sep:
            values[name] = value
        elif name in environ:
            values[name] = environ[name]
        else:
            missing.append(name)
    return values, missing


def is_exportable(name: str) -> bool:
    """Whether ``name`` should be forwarded to the ranks with Open MPI's ``-x NAME``.

    Like horovodrun, not the launching host's GPU mask (``*CUDA_VISIBLE_DEVICES``): each host
    has its own GPUs.  ``-x CUDA_VISIBLE_DEVICES=...`` still sets it explicitly."""
    return bool(_NAME_RE.match(name)) and name not in _NOT_EXPORTED \
        and not name.endswith("CUDA_VISIBLE_DEVICES")


def exportable_names(env: Mapping[str, str]) -> List[str]:
    """Sorted names from ``env`` that are forwarded to ranks (Open MPI needs them listed)."""
    return sorted(k for k in env if is_exportable(k))


def prepend_path(entry: str, current: Optional[str]) -> str:
    """``entry`` in front of a PATH-like value, without duplicating it."""
    parts = [p for p in (current or "").split(os.pathsep) if p and p != entry]
    return os.pathsep.join([entry] + parts)


def launcher_env(environ: Mapping[str, str], set_vars: Mapping[str, str]) -> Dict[str, str]:
    """The launcher's environment: ours, minus per-rank identity vars, plus ``set_vars``."""
    env = {k: v for k, v in environ.items() if k not in PER_RANK_VARS}
    env.update(set_vars)
    return env
