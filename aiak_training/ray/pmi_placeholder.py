"""The process MPICH's hydra starts for each rank of a Ray MPI world, in the actor's place.

Hydra can only hand an MPI identity to a process it starts itself, and a Ray actor is started
by Ray.  So hydra starts this placeholder as rank ``PMI_ID``; it gives its identity (the
``PMI_PORT`` of its node's proxy, its ``PMI_ID``, hydra's local-rank hints) to the actor that
is really that rank, over an authenticated local connection, and then stays alive for as
long as the actor does: hydra counts the rank as running while this process runs.  The actor
calls ``MPI_Init`` with that identity and joins the world (``aiak_training.ray.mpi_world``).

Run by hydra only: ``python -m aiak_training.ray.pmi_placeholder``.
"""
from __future__ import annotations

import json
import os
import sys
from multiprocessing.connection import Client

from aiak_training.ray.mpi_world import ADDRS_ENV, KEY_ENV, pmi_identity


def main() -> int:
    rank = os.environ.get("PMI_ID", "")
    try:
        host, port = json.loads(os.environ[ADDRS_ENV])[rank]
        key = bytes.fromhex(os.environ[KEY_ENV])
    except (KeyError, ValueError) as exc:
        print(f"aiak_training.ray: placeholder of rank {rank!r}: no actor address for it "
              f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return 2
    conn = Client((host, int(port)), authkey=key)
    conn.send(pmi_identity(os.environ))
    try:
        conn.recv()  # nothing is ever sent: this returns when the actor's end closes
    except (EOFError, OSError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
