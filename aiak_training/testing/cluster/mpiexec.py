"""``mpiexec`` inside the emulated cluster: where MPICH's launcher is, and the arguments that
place ranks on the emulated nodes."""
from __future__ import annotations

import os
import shutil
import sys
from typing import Mapping

from aiak_training.testing.cluster.constants import CLUSTER_ENV_KEYS, ClusterError


def find_mpiexec() -> str | None:
    """MPICH's mpiexec next to the running interpreter first (a pyenv shim is a slow script)."""
    here = os.path.dirname(os.path.realpath(sys.executable))
    for name in ("mpiexec.hydra", "mpiexec"):
        path = os.path.join(here, name)
        if os.access(path, os.X_OK):
            return path
    return shutil.which("mpiexec")


def mpiexec_args(nranks: int | None = None, env: Mapping[str, str] | None = None) -> list[str]:
    """``mpiexec`` argv prefix that places ``nranks`` ranks on the emulated cluster.

    Reads the ``AIAK_CLUSTER_*`` variables (from ``env`` or ``os.environ``), so it works in
    any process started by :meth:`EmulatedCluster.run` or the CLI.  ``nranks`` defaults to
    nodes x ranks_per_node; ranks fill node 0 first (block placement), as hydra does with
    ``host:slots``.  Append the program and its arguments to the returned list.
    """
    source = os.environ if env is None else env
    missing = [k for k in CLUSTER_ENV_KEYS if not source.get(k)]
    if missing:
        raise ClusterError(f"not inside an emulated cluster ({', '.join(missing)} unset); "
                           "run through `python -m aiak_training.testing.cluster`")
    if nranks is None:
        nranks = int(source["AIAK_CLUSTER_NODES"]) * int(source["AIAK_CLUSTER_RANKS_PER_NODE"])
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    mpiexec = source.get("AIAK_CLUSTER_MPIEXEC") or find_mpiexec() or "mpiexec"
    return [mpiexec,
            "-launcher", "ssh",
            "-launcher-exec", source["AIAK_CLUSTER_LAUNCHER_EXEC"],
            "-iface", source["AIAK_CLUSTER_IFACE"],
            "-hosts", source["AIAK_CLUSTER_HOSTS"],
            "-n", str(nranks)]
