"""The emulated network's fixed names and addresses, the MPI settings that keep its traffic
on the shaped links, and the errors of the emulated cluster."""
from __future__ import annotations

import re



#: Name of the node-side interface, identical in every namespace so one ``-iface`` fits all.
IFACE_NAME = "aiak0"
#: TEST-NET-1 (RFC 5737): reserved for documentation, never routed, so it cannot clash with a
#: real network; only ever assigned to interfaces this module creates.
SUBNET = "192.0.2."
MAX_NODES = 250
#: Names are ``aiak<3 digits>`` + suffix; 3 digits keep every name within IFNAMSIZ (15).
NAME_STEM = "aiak"
PREFIX_RE = re.compile(r"^aiak\d{3}$")
#: Lock files that claim a prefix; /run is a tmpfs, cleared (like the namespaces) at boot.
LOCK_DIR = "/run/aiak_cluster"
#: TCP port of the link-rate measurement; it only listens inside this run's node-1 namespace.
LINK_RATE_PORT = 47001

#: Environment that makes this MPICH wheel (ch4, netmods ucx and ofi; ucx is the default)
#: carry inter-node traffic over TCP on the emulated links.  Without it, UCX picks its
#: shared-memory transports between "nodes" (the namespaces share /dev/shm and the kernel),
#: which measured 8.8 GB/s across a 1 Gbit/s link: the shaping is silently bypassed.
#: ofi+tcp is the default here; the UCX_* entries make ``MPIR_CVAR_CH4_NETMOD=ucx`` safe too.
#: Intra-node traffic still uses MPICH's own shared memory.
MPI_TRANSPORT_ENV: dict[str, str] = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": IFACE_NAME,
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": IFACE_NAME,
}

CLUSTER_ENV_KEYS = (
    "AIAK_CLUSTER_HOSTS",
    "AIAK_CLUSTER_LAUNCHER_EXEC",
    "AIAK_CLUSTER_IFACE",
    "AIAK_CLUSTER_NODES",
    "AIAK_CLUSTER_RANKS_PER_NODE",
    "AIAK_CLUSTER_LINK_GBIT",
)


class ClusterError(RuntimeError):
    """Setting up, verifying or running the emulated cluster failed."""


class ClusterUnavailable(ClusterError):
    """This machine or user cannot emulate a cluster (not root, tools missing, no netns)."""


class LinkRateMismatch(ClusterError):
    """The measured cross-node throughput is too far from the requested link rate."""
