"""What the Ray and Spark front ends share: rank layout, worker environment, pickling checks.

Both are schedulers: they place and start the workers themselves, so the launcher's job shrinks to three
things done here: give ranks of one host contiguous numbers (the Gloo transport requires it
and hierarchical allreduce relies on it), compute each rank's Horovod environment from where
the workers landed, and start the rendezvous store that Gloo ranks meet at.  Spark tasks
always form a Gloo world; a fixed-size ``RayExecutor`` forms an MPI world through MPICH's
hydra where it can (``ray/mpi_world.py``, :func:`~aiak_training.ray.mpi_world.ray_transport`)
and a Gloo world otherwise, and elastic Ray jobs use Gloo.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import cloudpickle

from aiak_training.common.job.ranks import place_ranks


def contiguous_order(host_keys: Sequence[str]) -> List[int]:
    """Worker indices reordered so that workers on one host are adjacent.

    Hosts keep the order of their first appearance and workers keep their order within a
    host, so an already grouped placement is returned unchanged.  Position ``r`` of the
    result is the worker that becomes rank ``r``.
    """
    groups: Dict[str, List[int]] = {}
    for index, key in enumerate(host_keys):
        groups.setdefault(key, []).append(index)
    return list(itertools.chain.from_iterable(groups.values()))


def nic_env(nics: Optional[Sequence[str]], gloo: bool = True) -> Dict[str, str]:
    """The variables that pin a job to ``nics``, in the order given (sort a set first): as
    in Horovod, Gloo binds the first interface and NCCL may use all of them."""
    if not nics:
        return {}
    names = list(nics)
    env = {"NCCL_SOCKET_IFNAME": ",".join(names)}
    if gloo:
        env["HOROVOD_GLOO_IFACE"] = names[0]
    return env


def rank_envs(hosts_by_rank: Sequence[str], addr: str, port: int, prefix: str = "",
              timeout_s: Optional[float] = None, nics: Optional[Sequence[str]] = None,
              extra: Optional[Dict[str, Any]] = None,
              transport: str = "gloo") -> List[Dict[str, str]]:
    """The environment of every rank: Horovod's identity variables and, for ``transport``
    "gloo", the Gloo rendezvous (for "mpi", ``addr``/``port``/``prefix`` are unused and
    ``timeout_s`` becomes the collective watchdog's bound).

    ``extra`` (the user's variables) is applied last, so it may override anything.  Leave
    ``prefix`` empty when the store serves only this job: the ranks then key each world
    they form (every ``hvd.init()`` after a ``shutdown()``) by its sequence number, which a
    fixed prefix would not do.  Raises ValueError when the ranks of one host are not
    adjacent (order the workers with :func:`contiguous_order` first).
    """
    if transport == "mpi":
        common = {"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi"}
        if timeout_s is not None:
            common["AIAK_COLLECTIVE_TIMEOUT_SECONDS"] = str(int(max(1, timeout_s)))
    else:
        common = {
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        }
        if prefix:
            common["AIAK_GLOO_STORE_PREFIX"] = prefix
        if timeout_s is not None:
            common["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(int(max(1, timeout_s)))
    common.update(nic_env(nics, gloo=transport != "mpi"))
    if contiguous_order(hosts_by_rank) != list(range(len(hosts_by_rank))):
        raise ValueError(f"ranks of one host are not contiguous: {list(hosts_by_rank)}")
    user = {k: str(v) for k, v in (extra or {}).items()}
    return [{**common, **r.horovod_env(), **user} for r in place_ranks(hosts_by_rank)]


def pickled(obj: Any, what: str, name: Optional[str] = None) -> bytes:
    """``obj`` serialised with cloudpickle, or a TypeError naming ``what`` and the reason.

    Called on the driver before anything is sent to a worker, so a closure over a lock or a
    socket fails at once instead of inside every worker.
    """
    try:
        return cloudpickle.dumps(obj)
    except Exception as exc:  # cloudpickle raises TypeError, PicklingError, RecursionError...
        name = name or getattr(obj, "__qualname__", None) or type(obj).__name__
        raise TypeError(f"{what} {name!r} cannot be pickled, so it cannot be sent to the "
                        f"workers: {type(exc).__name__}: {exc}") from exc


def start_store(host: str = "0.0.0.0") -> Tuple[object, int]:
    """Start the Gloo rendezvous store (a TCPStore server) here; returns (server, port).

    Keep the server object alive as long as the job runs.
    """
    from aiak_training.runtime.transport.gloo import start_rendezvous_server
    return start_rendezvous_server(host, 0)

