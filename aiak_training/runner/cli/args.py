"""``aiakrun`` command line: horovodrun's flags plus aiak-training's own."""
from __future__ import annotations

import argparse
from typing import List, Optional, Sequence, Tuple

from aiak_training.common.config import ALLREDUCE_ALGO_ALIASES, ALLREDUCE_ALGOS, LOG_LEVELS
from aiak_training.common.tuning import (ALLREDUCE_ALGORITHM, CYCLE_TIME, FUSED_OPTIMIZER,
                                         FUSION_THRESHOLD, HIERARCHICAL_ALLREDUCE_VARIABLE,
                                         OVERLAP_UPDATE, RESPONSE_CACHE)
from aiak_training.runner.cli.flag_errors import FlagParser

# horovodrun's elastic flags (runner/modes/elastic/launch.py validates and runs them); giving
# --host-discovery-script or --min-np turns elastic mode on.
ELASTIC_FLAGS = ("--min-np", "--max-np", "--slots-per-host", "--elastic-timeout",
                 "--reset-limit", "--blacklist-cooldown-range", "--host-discovery-script")
# What --help shows for each flag's value: argparse would otherwise build it from the dest
# (ELASTIC_ELASTIC_TIMEOUT), and print a two-value flag's placeholder twice.
ELASTIC_METAVARS = {
    "--min-np": "N", "--max-np": "N", "--slots-per-host": "N", "--elastic-timeout": "SECONDS",
    "--reset-limit": "N", "--blacklist-cooldown-range": ("MIN", "MAX"),
    "--host-discovery-script": "SCRIPT",
}
ELASTIC_HELP = {
    "--min-np": "elastic: fewest ranks the job may run on (also --min-num-proc)",
    "--max-np": "elastic: most ranks the job may grow to (also --max-num-proc)",
    "--slots-per-host": "elastic: slots of a discovered host listed without ':slots' "
                        "(default 1)",
    "--elastic-timeout": "elastic: seconds to wait for --min-np slots before failing "
                         "(HOROVOD_ELASTIC_TIMEOUT; default 600)",
    "--reset-limit": "elastic: fail the job instead of resetting it more than this many times",
    "--blacklist-cooldown-range": "elastic: seconds (from MIN to MAX) a host whose worker "
                                  "failed stays blacklisted (default: for good)",
    "--host-discovery-script": "elastic: executable printing the available hosts, one "
                               "'hostname[:slots]' per line",
}
# horovodrun flags that only tune performance (NCCL streams, thread affinity, the torus
# allreduce) or the look of the output: a job runs correctly without them, so they are
# accepted, named in a warning, and ignored.  Flag (with aliases) -> whether it takes a value.
IGNORED_FLAGS = {
    ("--num-nccl-streams",): True, ("--thread-affinity",): True,
    ("--torus-allreduce",): False, ("--no-torus-allreduce",): False,
    ("--prefix-output-with-timestamp", "-prefix-timestamp"): False,
}


def _ignored_dest(flags: Tuple[str, ...]) -> str:
    return "ignored_" + flags[0].lstrip("-").replace("-", "_")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _what_if(text: str):
    """--what-if's value; an error names the bad field (aiak_training/advisor/whatif.py)."""
    from aiak_training.advisor.whatif import WhatIfError, parse_what_if
    try:
        return parse_what_if(text)
    except WhatIfError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _on_off(group, name: str, dest: str, help_on: str) -> None:
    """``--name`` / ``--no-name`` pair storing True/False, None when neither is given."""
    group.add_argument(f"--{name}", dest=dest, action="store_const", const=True, default=None,
                       help=help_on)
    group.add_argument(f"--no-{name}", dest=dest, action="store_const", const=False,
                       help=f"explicitly turn off --{name}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; flag names and meanings follow horovodrun 0.28.1."""
    # allow_abbrev=False, unlike horovodrun: argparse matches prefixes in every argument,
    # the training command's own included, so a script flag such as --fus would be taken
    # (or rejected as ambiguous) by aiakrun.
    p = FlagParser(  # one-line errors with "did you mean" (runner/cli/flag_errors.py)
        prog="aiakrun",
        description="Launch a distributed aiak-training (Horovod-compatible) job over MPI.",
        epilog="Example: aiakrun -np 4 -H server1:2,server2:2 python train.py",
        allow_abbrev=False)
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("-np", "--num-proc", dest="num_proc", type=_positive_int, metavar="N",
                   help="total number of ranks (processes) to start")
    p.add_argument("-cb", "--check-build", dest="check_build", action="store_true",
                   help="show the frameworks, controllers and tensor operations available, "
                        "then exit")
    p.add_argument("--disable-cache", action="store_true",
                   help="accepted for horovodrun compatibility; aiakrun caches nothing")
    p.add_argument("--start-timeout", type=_positive_int, metavar="SECONDS",
                   help="accepted for horovodrun compatibility and exported as "
                        "HOROVOD_START_TIMEOUT (default: $HOROVOD_START_TIMEOUT or 30); "
                        "horovodrun spends it on host checks that aiakrun does not run")
    p.add_argument("--network-interfaces", dest="network_interfaces", metavar="NICS",
                   help="comma-separated network interfaces for MPI and NCCL, e.g. eth0,eth1")
    p.add_argument("--network-interface", dest="network_interface", action="append", metavar="NIC",
                   help="one network interface (deprecated horovodrun form; repeatable)")
    p.add_argument("--output-filename", dest="output_filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.<N>/{stdout,stderr}")
    p.add_argument("--verbose", action="count", default=0,
                   help="print the MPI command line before running it")
    p.add_argument("--config-file", dest="config_file", help=argparse.SUPPRESS)

    ssh = p.add_argument_group("SSH")
    ssh.add_argument("-p", "--ssh-port", dest="ssh_port", type=_positive_int, metavar="PORT",
                     help="SSH port on all the hosts")
    ssh.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE",
                     help="SSH identity (private key) file")

    tun = p.add_argument_group("tunables (mapped to Horovod's environment variables)")
    tun.add_argument(FUSION_THRESHOLD.flag, dest="fusion_threshold_mb", metavar="MB",
                     type=_non_negative_int,
                     help="tensor fusion buffer size in MiB; 0 disables fusion "
                          f"({FUSION_THRESHOLD.variable}, bytes; default 128 MiB)")
    tun.add_argument(CYCLE_TIME.flag, dest="cycle_time_ms", metavar="MS",
                     type=_non_negative_float,
                     help=f"background cycle time in ms ({CYCLE_TIME.variable}; default 1)")
    tun.add_argument(RESPONSE_CACHE.flag, dest="cache_capacity", type=_non_negative_int,
                     metavar="N",
                     help=f"response cache entries; 0 disables ({RESPONSE_CACHE.variable}; "
                          "default 1024)")
    _on_off(tun, "hierarchical-allreduce", "hierarchical_allreduce",
            f"intra-node then inter-node allreduce ({HIERARCHICAL_ALLREDUCE_VARIABLE})")
    _on_off(tun, "hierarchical-allgather", "hierarchical_allgather",
            "hierarchical allgather (HOROVOD_HIERARCHICAL_ALLGATHER; accepted, no effect: "
            "allgather always uses MPI's own algorithm)")
    _on_off(tun, "mpi-threads-disable", "mpi_threads_disable",
            "initialize MPI with MPI_THREAD_SERIALIZED instead of MULTIPLE "
            "(HOROVOD_MPI_THREADS_DISABLE)")
    tun.add_argument("--tcp", action="store_true",
                     help="TCP only: NCCL_IB_DISABLE=1 (and -tcp for Spectrum MPI)")
    for flags, takes_value in IGNORED_FLAGS.items():
        tun.add_argument(*flags, dest=_ignored_dest(flags), nargs=None if takes_value else 0,
                         action=_Collect, help=argparse.SUPPRESS)

    _add_autotune_flags(p)

    tl = p.add_argument_group("timeline")
    tl.add_argument("--timeline-filename", dest="timeline_filename", metavar="FILE",
                    help="write a Chrome-trace timeline (HOROVOD_TIMELINE)")
    _on_off(tl, "timeline-mark-cycles", "timeline_mark_cycles",
            "mark background cycles in the timeline (HOROVOD_TIMELINE_MARK_CYCLES)")

    st = p.add_argument_group("stall check")
    st.add_argument("--no-stall-check", dest="no_stall_check", action="store_true",
                    help="disable the stall check (HOROVOD_STALL_CHECK_DISABLE=1)")
    st.add_argument("--stall-check", dest="stall_check", action="store_true",
                    help="enable the stall check (the default; HOROVOD_STALL_CHECK_DISABLE=0)")
    st.add_argument("--stall-check-warning-time-seconds", dest="stall_check_warning_time_seconds",
                    type=_non_negative_int, metavar="SECONDS",
                    help="warn after this many seconds of stall "
                         "(HOROVOD_STALL_CHECK_TIME_SECONDS; default 60)")
    st.add_argument("--stall-check-shutdown-time-seconds",
                    dest="stall_check_shutdown_time_seconds", type=_non_negative_int,
                    metavar="SECONDS",
                    help="shut down after this many seconds of stall; 0 never "
                         "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")

    lib = p.add_argument_group("MPI")
    lib.add_argument("--mpi-args", dest="mpi_args", metavar="ARGS",
                     help="extra arguments for mpirun, e.g. --mpi-args=\"-verbose\"")
    lib.add_argument("--binding-args", dest="binding_args", metavar="ARGS",
                     help="process binding arguments that replace the defaults")

    log = p.add_argument_group("logging")
    log.add_argument("--log-level", dest="log_level", type=str.upper,
                     choices=[level.upper() for level in LOG_LEVELS],
                     help="engine log level (HOROVOD_LOG_LEVEL); WARNING and higher also "
                          "silence rank 0's start-up line")
    log.add_argument("--log-with-timestamp", "--no-log-hide-timestamp", dest="log_hide_time",
                     action="store_const", const=False, default=None,
                     help="timestamps in engine logs")
    log.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_hide_time",
                     action="store_const", const=True,
                     help="no timestamps in engine logs (HOROVOD_LOG_HIDE_TIME=1)")

    hosts = p.add_argument_group("hosts").add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", metavar="HOSTS",
                       help="hosts and slots, e.g. server1:2,server2:4 (default localhost:NP)")
    hosts.add_argument("-hostfile", "--hostfile", dest="hostfile", metavar="FILE",
                       help="file with lines 'hostname slots=N'")

    ctl = p.add_argument_group("controller").add_mutually_exclusive_group()
    ctl.add_argument("--mpi", dest="use_mpi", action="store_true",
                     help="use MPI (the default controller)")
    ctl.add_argument("--gloo", dest="use_gloo", action="store_true",
                     help="run without MPI: ranks rendezvous through a store on this host and "
                          "talk over Gloo (docs/gloo.md)")
    ctl.add_argument("--jsrun", dest="use_jsrun", action="store_true", help=argparse.SUPPRESS)

    el = p.add_argument_group("elastic (on Gloo; docs/elastic.md)")
    for flag in ELASTIC_FLAGS:
        el.add_argument(flag, dest="elastic_" + flag[2:].replace("-", "_"),
                        nargs=2 if flag == "--blacklist-cooldown-range" else None,
                        metavar=ELASTIC_METAVARS[flag], help=ELASTIC_HELP[flag])
    el.add_argument("--min-num-proc", dest="elastic_min_np", help=argparse.SUPPRESS)
    el.add_argument("--max-num-proc", dest="elastic_max_np", help=argparse.SUPPRESS)

    ours = p.add_argument_group("aiak-training")
    ours.add_argument("-x", dest="env_vars", action="append", default=[], metavar="VAR[=VAL]",
                      help="set VAR to VAL on every rank, or pass this shell's VAR (repeatable; "
                           "the whole environment is passed anyway, as horovodrun does)")
    ours.add_argument(OVERLAP_UPDATE.flag, dest="overlap_update", action="store_true",
                      help="overlap optimizer updates with communication "
                           f"({OVERLAP_UPDATE.variable}=1)")
    ours.add_argument(ALLREDUCE_ALGORITHM.flag, dest="allreduce_algo",
                      choices=ALLREDUCE_ALGOS + tuple(ALLREDUCE_ALGO_ALIASES),
                      help=f"allreduce algorithm ({ALLREDUCE_ALGORITHM.variable}; default auto)")
    ours.add_argument(FUSED_OPTIMIZER.flag, dest="fused_optimizer", action="store_true",
                      help=f"use the fused optimizer kernels ({FUSED_OPTIMIZER.variable}=1)")
    ours.add_argument("--virtual-hosts", dest="virtual_hosts", action="store_true",
                      help="run every rank on this machine, each with the host identity of its "
                           "-H/--hostfile slot (HOROVOD_HOSTNAME); also AIAK_VIRTUAL_HOSTS=1")
    ours.add_argument("--horovod-compat", dest="horovod_compat", action="store_true",
                      help="make `import horovod.torch` load aiak-training (no script edits); "
                           "also AIAK_HOROVOD_COMPAT=1")
    adv = p.add_argument_group("advisor (docs/choosing-a-configuration.md)")
    adv.add_argument("--advise", action="store_true",
                     help="measure the links, the model's gradients and a few steps of the "
                          "script, then print each configuration's predicted step time")
    adv.add_argument("--what-if", dest="what_if", type=_what_if, metavar="FIELDS",
                     help="with --advise: predict for another cluster, e.g. "
                          "nodes=2,ranks_per_node=8,link_gbit=30[,latency_us=50]; for a GPU "
                          "cluster also compute_ms=,update_ms=[,fused_update_ms=],intra_gbit= "
                          "or profile=FILE (see docs/choosing-a-configuration.md)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, with arguments")
    return p


def _add_autotune_flags(p: argparse.ArgumentParser) -> None:
    """horovodrun's autotune flags; each sets its HOROVOD_AUTOTUNE* variable
    (runner/cli/env_map.py), read by the ranks (aiak_training/runtime/autotune/)."""
    at = p.add_argument_group("autotune (docs/choosing-a-configuration.md)")
    _on_off(at, "autotune", "autotune",
            "tune the fusion threshold, cycle time and allreduce algorithm on the job's "
            "measured step time, then keep the best (HOROVOD_AUTOTUNE)")
    at.add_argument("--autotune-log-file", dest="autotune_log_file", metavar="FILE",
                    help="CSV of every setting tried, the chosen one last (HOROVOD_AUTOTUNE_LOG)")
    at.add_argument("--autotune-warmup-samples", dest="autotune_warmup_samples",
                    type=_non_negative_int, metavar="N",
                    help="samples discarded before tuning (HOROVOD_AUTOTUNE_WARMUP_SAMPLES; "
                         "default 3)")
    at.add_argument("--autotune-steps-per-sample", dest="autotune_steps_per_sample",
                    type=_positive_int, metavar="N",
                    help="steps measured per setting (HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE; "
                         "default 10)")
    at.add_argument("--autotune-bayes-opt-max-samples", dest="autotune_bayes_opt_max_samples",
                    type=_positive_int, metavar="N",
                    help="most settings measured (HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES; "
                         "default 20)")
    at.add_argument("--autotune-gaussian-process-noise",
                    dest="autotune_gaussian_process_noise", type=_non_negative_float,
                    metavar="ALPHA",
                    help="accepted for horovodrun compatibility; the search here is not a "
                         "Gaussian process (HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE; default 0.8)")


class _Collect(argparse.Action):
    """Store a value (or True for valueless flags) so ignored flags can be reported."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True if values == [] else values)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); a leading ``--`` before the command is dropped."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    command: List[str] = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    args.command = command
    return args


def network_interfaces(args: argparse.Namespace) -> List[str]:
    """Interfaces from --network-interfaces and every --network-interface, in order, unique."""
    names: List[str] = []
    if args.network_interfaces:
        names += [n.strip() for n in args.network_interfaces.split(",") if n.strip()]
    for item in args.network_interface or []:
        names += [n.strip() for n in item.split(",") if n.strip()]
    return list(dict.fromkeys(names))


def unsupported_flags(args: argparse.Namespace) -> List[str]:
    """Human-readable reasons this command line cannot run (empty when it can)."""
    problems = []
    if args.use_jsrun:
        problems.append("--jsrun: LSF/jsrun launching is not supported; use -H/--hostfile")
    if args.config_file:
        problems.append("--config-file: YAML config files are not supported; pass the "
                        "equivalent flags")
    return problems


def ignored_flags(args: argparse.Namespace) -> List[str]:
    """Flags accepted for compatibility that have no effect here."""
    return [flags[0] for flags in IGNORED_FLAGS
            if getattr(args, _ignored_dest(flags), None) is not None]
