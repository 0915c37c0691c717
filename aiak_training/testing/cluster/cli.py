"""The command line, ``python -m aiak_training.testing.cluster``: run one command on an
emulated cluster, check whether this machine can emulate one, or clean up dead runs."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import warnings
from typing import Sequence

from aiak_training.testing.cluster.constants import (IFACE_NAME, MAX_NODES, ClusterError,
                                                     ClusterUnavailable, LinkRateMismatch)
from aiak_training.testing.cluster.emulator import EmulatedCluster, default_log
from aiak_training.testing.cluster.namespaces import can_emulate, cleanup_stale
from aiak_training.testing.cluster.rates import parse_rate, rate_arg, size_arg
from aiak_training.testing.cluster.requirements import static_requirements


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aiak_training.testing.cluster",
        description="Run a command on an emulated cluster of NODES x RANKS_PER_NODE joined by "
                    "links of RATE (network namespaces + tc tbf). Needs root, ip, tc, unshare.",
        epilog="Example: python -m aiak_training.testing.cluster --nodes 2 --ranks-per-node 2 "
               "--rate 1gbit -- sh -c 'mpiexec -n 4 python bench.py'")
    p.add_argument("--nodes", type=int, default=2, help="number of emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="MPI slots per node, published to the launcher (default 1)")
    p.add_argument("--rate", type=rate_arg, default=parse_rate("1gbit"),
                   help="link rate per node, e.g. 1gbit, 500mbit, 5gbit (default 1gbit)")
    p.add_argument("--burst", type=size_arg, default=None,
                   help="tbf bucket size, e.g. 256kb (default: 0.5 ms of traffic, >= 256kb)")
    verify = p.add_mutually_exclusive_group()
    verify.add_argument("--require-rate", dest="verify", action="store_const", const="require",
                        help="fail (exit 3) if the measured rate is off by more than tolerance")
    verify.add_argument("--no-verify", dest="verify", action="store_const", const="off",
                        help="skip the throughput measurement (qdiscs are still checked)")
    p.set_defaults(verify="warn")
    p.add_argument("--tolerance", type=float, default=0.2,
                   help="allowed relative deviation of the measured rate (default 0.2)")
    p.add_argument("--measure-seconds", type=float, default=1.0,
                   help="duration of the link measurement (default 1.0)")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill the command after this many seconds (exit 124)")
    p.add_argument("--prefix", default=None, help="force a name prefix (aiakNNN)")
    p.add_argument("--cleanup-stale", action="store_true",
                   help="remove leftovers of dead runs and exit (no command needed)")
    p.add_argument("--check", action="store_true",
                   help="report whether this machine can emulate a cluster and exit (0/2)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="command to run in node 0 (put it after --)")
    return p


def parse_cli(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``args.command`` is the command without the leading ``--``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    args.command = command
    if not (args.cleanup_stale or args.check) and not command:
        parser.error("no command given; put it after --")
    if args.nodes < 1 or args.nodes > MAX_NODES:
        parser.error(f"--nodes must be in 1..{MAX_NODES}")
    if args.ranks_per_node < 1:
        parser.error("--ranks-per-node must be >= 1")
    if not 0 < args.tolerance < 1:
        parser.error("--tolerance must be in (0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the command's exit status (2: cannot emulate, 3: bad rate)."""
    args = parse_cli(argv)
    log = None if args.quiet else default_log
    if args.check:
        ok, why = can_emulate()
        print(("can emulate: " if ok else "cannot emulate: ") + why,
              file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 2
    if args.cleanup_stale:
        reason = static_requirements()
        if reason:
            print(f"aiak-cluster: {reason}", file=sys.stderr)
            return 2
        cleaned = cleanup_stale(default_log)
        default_log(f"cleaned {len(cleaned)} stale run(s)" + (f": {cleaned}" if cleaned else ""))
        if not args.command:
            return 0
    if log:
        # The loud banner is printed already; the RuntimeWarning copy would only repeat it.
        # (Every module of this package: the warning comes from the emulator.)
        warnings.filterwarnings("ignore", category=RuntimeWarning,
                                module=r"aiak_training\.testing\.cluster")
    try:
        with EmulatedCluster(args.nodes, args.ranks_per_node, args.rate, verify=args.verify,
                             tolerance=args.tolerance, measure_seconds=args.measure_seconds,
                             burst_bytes=args.burst, prefix=args.prefix, log=log) as cluster:
            if log:
                link = ("not measured" if cluster.measured_gbit is None else
                        f"{cluster.measured_gbit:.3f} Gbit/s measured")
                log(f"{cluster.prefix}: up: nodes {', '.join(cluster.node_names)}; "
                    f"hosts {cluster.host_spec}; iface {IFACE_NAME}; link {link}; "
                    f"running: {shlex.join(args.command)}")
            proc = cluster.run(args.command, timeout=args.timeout)
            code = proc.returncode
            return 128 - code if code < 0 else code
    except ClusterUnavailable as exc:
        print(f"aiak-cluster: cannot emulate a cluster: {exc}", file=sys.stderr)
        return 2
    except LinkRateMismatch as exc:
        print(f"aiak-cluster: {exc}", file=sys.stderr)
        return 3
    except subprocess.TimeoutExpired:
        print(f"aiak-cluster: command timed out after {args.timeout} s", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print("aiak-cluster: interrupted", file=sys.stderr)
        return 130
    except ClusterError as exc:
        print(f"aiak-cluster: {exc}", file=sys.stderr)
        return 1
