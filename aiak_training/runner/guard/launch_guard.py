"""aiakrun's side of the guards that keep a job from outliving or hiding its launcher.

Kept apart from launch.py so that its hook there stays two lines: :func:`start_guards` opens
the liveness port (runner/guard/liveness.py) and puts its address into the ranks' environment, and
returns the output reader (runner/report/launcher_output.py) for :func:`supervise.run_job`.
"""
from __future__ import annotations

import dataclasses
import socket
from typing import Dict, Tuple

from aiak_training.compat import COMPAT_ENV
from aiak_training.runner.cli.hosts import is_local_host, unreachable
from aiak_training.runner.guard.liveness import LIVENESS_ENV, LivenessServer
from aiak_training.runner.guard.supervise import JobResult
from aiak_training.runner.modes.mpi_flavour import Flavour
from aiak_training.runner.modes.mpi_run import LaunchSpec
from aiak_training.runner.report.blame import culprit_line, read_notes
from aiak_training.runner.report.launcher_output import HOROVOD_COMPAT_HINT, LauncherOutput


def start_guards(spec: LaunchSpec, env: Dict[str, str],
                 verbose: bool) -> Tuple[LaunchSpec, LivenessServer, LauncherOutput]:
    """Open the liveness port and set ``$AIAK_LAUNCHER_LIVENESS`` in ``env`` (in place).

    Hydra-based launchers pass aiakrun's whole environment on (``-genvall``); Open MPI only
    what is named with ``-x``, so the variable joins ``spec.export_names`` there.  The caller
    closes the server when the job is over.
    """
    local = spec.virtual_hosts or all(is_local_host(h.name) for h in spec.hosts)
    preferred = ([spec.iface] if spec.iface else []) + list(spec.nics)
    server = LivenessServer(local_only=local, preferred_interfaces=preferred)
    env[LIVENESS_ENV] = server.env_value()
    if spec.flavour in (Flavour.OPENMPI, Flavour.SPECTRUM) and \
            LIVENESS_ENV not in spec.export_names:
        spec = dataclasses.replace(spec, export_names=tuple(spec.export_names) + (LIVENESS_ENV,))
    return spec, server, LauncherOutput(raw=verbose)


def finish_result(result: JobResult, output: LauncherOutput, spec: LaunchSpec,
                  failure_dir: str) -> None:
    """Complete ``result`` for the summary: the culprit with its host where the runtime's
    notes did not say it, and one-line hints from what the job printed."""
    if result.culprit:
        notes = read_notes(failure_dir)
        placed: Dict[int, str] = {}  # rank -> host as given to the launcher
        rank = 0
        for h in spec.hosts:
            for _ in range(h.slots):
                placed[rank] = h.name
                rank += 1
        # Ranks name their host as they see it (its hostname); use those names for every
        # rank placed on the same launcher host, so that one summary uses one name per host.
        seen = {n.rank: n.host for n in list(notes) + list(result.failures)
                if n.rank is not None}
        alias = {placed[r]: host for r, host in seen.items() if r in placed}
        here = socket.gethostname()
        hosts = {r: alias.get(name, name if spec.virtual_hosts or not is_local_host(name)
                              else here) for r, name in placed.items()}
        result.culprit = culprit_line(result.failures, notes, hosts) or result.culprit
    if output.ssh_failure is not None and not result.failures:
        result.unreachable = unreachable(*output.ssh_failure, spec.hosts_source)
    if output.horovod_missing and COMPAT_ENV not in spec.set_env:
        result.hints.append(HOROVOD_COMPAT_HINT)
    if output.keras2_hint and result.exit_code != 0:
        result.hints.append(output.keras2_hint)
