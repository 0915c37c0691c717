"""Emulate a multi-node cluster with a slow network on one Linux machine.

The package: ``constants`` (names, addresses, errors), ``rates``, ``requirements``,
``namespaces`` (prefixes, leftovers, destruction), ``impairments``, ``emulator``
(:class:`EmulatedCluster`), ``mpiexec`` and ``cli`` (``python -m aiak_training.testing.cluster``).

Layout (one run, ``P`` = a per-run prefix such as ``aiak042``)::

    switch:   namespace Psw holding bridge Pbr and the switch-side veth ends Pv0, Pv1, ...
    node i:   namespace Pn<i>, interface ``aiak0`` = 192.0.2.<i+1>/24 (peer of Pv<i>),
              hostname Pn<i> (set in a UTS namespace for each launched process)
    root:     nothing but the namespace names; no interface, address or route of ours

* Both ends of every veth get a ``tc tbf`` qdisc at the link rate: tbf only shapes egress,
  so the node end caps what a node sends and the switch end what it receives, like a
  full-duplex NIC.  Traffic between ranks of one node never leaves its namespace (loopback
  or shared memory), so it is not shaped.
* The bridge sits in a namespace of its own because bridged traffic in the root namespace
  passes its netfilter hooks (br_netfilter), which dropped the TCP SYNs between nodes here.
* Commands run inside node 0's namespace, as a job launched from a head node: the root
  namespace has no address on the emulated network (and could not connect into the
  namespaces in an earlier try), and MPICH's hydra must run where its proxies can connect
  back.
* MPICH hydra reaches the other nodes through a generated *launch agent* used in place of
  ``ssh`` (``-launcher ssh -launcher-exec <agent>``). Hydra's host names are the node IP
  addresses, so nothing has to resolve names (no /etc/hosts edits); the agent maps an address
  to its namespace and sets the node's hostname in a fresh UTS namespace, so MPI (and
  ``socket.gethostname()``) sees distinct hosts.
* Before anything runs, the tool checks the qdiscs it set and measures the real cross-node
  TCP throughput, and refuses (or warns loudly) when it is off by more than a tolerance.
* For fault tests, :meth:`EmulatedCluster.impair` adds packet loss (a classic-BPF tc filter)
  and jitter (pauses of the link's tbf, or netem where the kernel has it) to the node links,
  and :meth:`EmulatedCluster.link_down` / ``link_up`` pull and restore a node's link.
* Everything is torn down on exit, on exceptions, on SIGINT/SIGTERM/SIGHUP and at interpreter
  exit; resources are only ever found by this run's own prefix, which is claimed with a lock
  file, so parallel runs and leftovers never collide and foreign interfaces are never touched.

Command line::

    python -m aiak_training.testing.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        sh -c 'mpiexec -n 4 python bench.py'

Python::

    from aiak_training.testing.cluster import EmulatedCluster
    with EmulatedCluster(nodes=2, ranks_per_node=2, rate_gbit=1.0) as cluster:
        proc = cluster.run(cluster.mpiexec_args() + [sys.executable, "bench.py"], timeout=120)

Inside the cluster these variables are set: ``AIAK_CLUSTER_HOSTS`` (hydra ``-hosts`` value),
``AIAK_CLUSTER_LAUNCHER_EXEC``, ``AIAK_CLUSTER_IFACE``, ``AIAK_CLUSTER_NODES``,
``AIAK_CLUSTER_RANKS_PER_NODE``, ``AIAK_CLUSTER_LINK_GBIT`` (measured), plus
``AIAK_CLUSTER_NODE_NAMES``, ``AIAK_CLUSTER_PREFIX``, ``AIAK_CLUSTER_MPIEXEC``, the MPICH
transport settings of :data:`MPI_TRANSPORT_ENV`, and ``HYDRA_*`` defaults so that a plain
``mpiexec -n 4 ...`` also spreads its ranks over the emulated nodes.

Requirements: Linux, root, ``ip`` and ``tc`` (iproute2), ``unshare`` and ``hostname``.
"""
from aiak_training.testing.cluster.cli import build_parser, main, parse_cli
from aiak_training.testing.cluster.constants import (IFACE_NAME, LOCK_DIR, MAX_NODES,
                                                     MPI_TRANSPORT_ENV, LINK_RATE_PORT, SUBNET,
                                                     ClusterError, ClusterUnavailable,
                                                     LinkRateMismatch)
from aiak_training.testing.cluster.emulator import EmulatedCluster
from aiak_training.testing.cluster.impairments import (link_command, loss_bytecode, loss_commands,
                                                       netem_commands, restore_child_command,
                                                       tbf_change_line, tbf_limit_bytes,
                                                       tbf_pause_line)
from aiak_training.testing.cluster.mpiexec import mpiexec_args
from aiak_training.testing.cluster.namespaces import cleanup_stale, leftovers
from aiak_training.testing.cluster.namespaces import can_emulate
from aiak_training.testing.cluster.rates import parse_rate, parse_size, tbf_burst_bytes

__all__ = [
    "ClusterError",
    "ClusterUnavailable",
    "EmulatedCluster",
    "LinkRateMismatch",
    "MPI_TRANSPORT_ENV",
    "can_emulate",
    "cleanup_stale",
    "leftovers",
    "link_command",
    "loss_bytecode",
    "loss_commands",
    "main",
    "mpiexec_args",
    "netem_commands",
    "parse_rate",
    "parse_size",
    "restore_child_command",
    "tbf_burst_bytes",
    "tbf_change_line",
    "tbf_limit_bytes",
    "tbf_pause_line",
]
