"""Build the MPI launcher's argv for each MPI flavour.

:func:`build_mpi_command` is pure (no environment, PATH or file access) so every flavour's
command line can be unit-tested on a machine that has only one MPI installed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence

from aiak_training.runner.cli.hosts import HostSlots
from aiak_training.runner.modes.mpi_flavour import Flavour

# Open MPI needs at least this many hosts before its launch tree workarounds matter
# (horovodrun uses the same threshold).
LARGE_CLUSTER_THRESHOLD = 64
VIRTUAL_HOST_MAP_VAR = "AIAK_VIRTUAL_HOST_MAP"


@dataclass(frozen=True)
class LaunchSpec:
    """Everything that decides the launcher command line.

    ``hosts`` lists the hosts that receive ranks and how many each gets (in rank order).  With
    ``virtual_hosts`` those names are identities only: every rank runs on this machine and gets
    ``HOROVOD_HOSTNAME`` set to the name of its slot.
    """

    launcher: str
    flavour: Flavour
    num_proc: int
    hosts: Sequence[HostSlots]
    command: Sequence[str]
    set_env: Mapping[str, str] = field(default_factory=dict)
    export_names: Sequence[str] = ()
    virtual_hosts: bool = False
    launcher_major_version: Optional[int] = None
    run_as_root: bool = False
    oversubscribe: bool = False
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    ssh_exec: Optional[str] = None
    cluster_launcher_exec: Optional[str] = None
    iface: Optional[str] = None
    nics: Sequence[str] = ()
    binding_args: Optional[Sequence[str]] = None
    extra_mpi_args: Sequence[str] = ()
    tcp: bool = False
    hosts_source: str = ""  # the flag that listed ``hosts`` ("-H", "--hostfile F"), for messages


def host_list(hosts: Sequence[HostSlots]) -> str:
    """``a:2,b:2``."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)


def _ssh_option_string(spec: LaunchSpec) -> str:
    opts = []
    if spec.ssh_port:
        opts += ["-p", str(spec.ssh_port)]
    if spec.ssh_identity_file:
        opts += ["-i", spec.ssh_identity_file]
    return " ".join(opts)


def build_mpi_command(spec: LaunchSpec) -> List[str]:
    """The full launcher argv for ``spec`` (dispatches on the flavour)."""
    if spec.num_proc != sum(h.slots for h in spec.hosts):
        raise ValueError(f"num_proc {spec.num_proc} does not match the host assignment "
                         f"{host_list(spec.hosts)}")
    if spec.flavour in (Flavour.MPICH, Flavour.INTEL):
        return _hydra_command(spec)
    return _open_mpi_command(spec)


def _hydra_command(spec: LaunchSpec) -> List[str]:
    """MPICH / Intel MPI (both use the Hydra process manager)."""
    intel = spec.flavour is Flavour.INTEL
    cmd = [spec.launcher, "-l"]
    if not spec.virtual_hosts:
        cmd += ["-n", str(spec.num_proc)]
    physical = [HostSlots("localhost", spec.num_proc)] if spec.virtual_hosts else list(spec.hosts)
    if intel:
        ppn = {h.slots for h in physical}
        if len(ppn) != 1:
            raise ValueError("Intel MPI needs the same number of ranks on every host "
                             f"(got {host_list(physical)}); pass a machinefile with "
                             "--mpi-args='-machinefile FILE' instead")
        cmd += ["-hosts", ",".join(h.name for h in physical), "-ppn", str(ppn.pop())]
    else:
        # host:slots keeps hosts with different slot counts exact (no -ppn needed).
        cmd += ["-hosts", host_list(physical)]
    if spec.binding_args is not None:
        cmd += list(spec.binding_args)
    elif not intel:
        cmd += ["-bind-to", "none"]
    if spec.cluster_launcher_exec and not intel:
        cmd += ["-launcher", "ssh", "-launcher-exec", spec.cluster_launcher_exec]
    elif intel and (spec.ssh_port or spec.ssh_identity_file):
        cmd += ["-bootstrap", "ssh", "-bootstrap-exec-args", _ssh_option_string(spec)]
    elif spec.ssh_exec:
        # MPICH's hydra has no option for ssh arguments; ssh_exec is a generated agent that
        # runs `ssh <port/identity options> "$@"`.
        cmd += ["-launcher", "ssh", "-launcher-exec", spec.ssh_exec]
    iface = spec.iface or (spec.nics[0] if spec.nics else None)
    if iface:
        cmd += ["-iface", iface]
    # Hydra forwards the launcher's whole environment by default; -genvall makes that explicit
    # (robust against HYDRA_ENV settings), -genv shows the values aiakrun chose.
    cmd.append("-genvall")
    for name, value in spec.set_env.items():
        cmd += ["-genv", name, value]
    cmd += list(spec.extra_mpi_args)
    if spec.virtual_hosts:
        # MPMD: one argument set per virtual host, each with its own HOROVOD_HOSTNAME.
        for i, host in enumerate(spec.hosts):
            if i:
                cmd.append(":")
            cmd += ["-n", str(host.slots), "-env", "HOROVOD_HOSTNAME", host.name]
            cmd += list(spec.command)
    else:
        cmd += list(spec.command)
    return cmd


def _open_mpi_command(spec: LaunchSpec) -> List[str]:
    """Open MPI (ORTE or PRRTE) and IBM Spectrum MPI."""
    spectrum = spec.flavour is Flavour.SPECTRUM
    cmd = [spec.launcher]
    if spec.run_as_root:
        cmd.append("--allow-run-as-root")
    cmd += ["--tag-output", "-np", str(spec.num_proc)]
    physical = [HostSlots("localhost", spec.num_proc)] if spec.virtual_hosts else list(spec.hosts)
    cmd += ["-H", host_list(physical)]
    if spec.binding_args is not None:
        cmd += list(spec.binding_args)
    elif spectrum:
        cmd += ["--bind-to", "socket", "--map-by", "socket", "--rank-by", "core"]
    else:
        # Double dash: Open MPI 5 (PRRTE) rejects horovodrun's single-dash -bind-to.
        cmd += ["--bind-to", "none", "--map-by", "slot"]
    if not spectrum and (spec.launcher_major_version is None or spec.launcher_major_version < 5):
        # horovodrun's defaults for Open MPI 4: avoid the openib BTL (fork-unsafe, deprecated).
        # Open MPI 5 has no openib component, and excluding it there only earns a warning.
        cmd += ["-mca", "pml", "ob1", "-mca", "btl", "^openib"]
    if spectrum and spec.tcp:
        cmd.append("-tcp")
    if len(physical) >= LARGE_CLUSTER_THRESHOLD:
        cmd += ["-mca", "plm_rsh_no_tree_spawn", "true",
                "-mca", "plm_rsh_num_concurrent", str(len(physical))]
    if spec.oversubscribe:
        cmd.append("--oversubscribe")
    ssh_opts = _ssh_option_string(spec)
    if ssh_opts:
        cmd += ["-mca", "plm_rsh_args", ssh_opts]
    if spec.nics:
        cmd += ["-mca", "btl_tcp_if_include", ",".join(spec.nics)]
    for name in spec.export_names:
        if name not in spec.set_env:
            cmd += ["-x", name]
    for name, value in spec.set_env.items():
        cmd += ["-x", f"{name}={value}"]
    if spec.virtual_hosts:
        # Open MPI 4 applies -x globally even in MPMD mode (openpmix/prrte#607), so per-rank
        # identities travel as one map that the task wrapper resolves with its rank.
        cmd += ["-x", f"{VIRTUAL_HOST_MAP_VAR}={host_list(spec.hosts)}"]
    cmd += list(spec.extra_mpi_args)
    cmd += list(spec.command)
    return cmd
