"""Keys and values the elastic driver and its workers exchange through the rendezvous store.

One ``torch.distributed.TCPStore`` on the launching host serves both the Gloo rendezvous of
every world (under ``<prefix>/world<R>``) and this small control protocol:

* ``<prefix>/waiting/<worker>`` = ``<n>``: the worker asks for its ``n``-th world (0 first);
* ``<prefix>/assign/<worker>/<n>`` = JSON: the driver's answer, either the worker's identity
  in round ``R`` (:func:`assignment`) or an order to stop (:func:`stop_order`);
* ``<prefix>/updates`` (a counter) and ``<prefix>/update/<i>`` = ``"<timestamp>,<flags>"``:
  host-change notifications, read by the workers at each ``commit()``.

Standard library only: the driver imports it without torch's distributed package in hand.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Tuple

DEFAULT_PREFIX = "aiak_elastic"
# Environment the driver gives each worker (besides Horovod's own HOROVOD_* names).
WORKER_ID_ENV = "AIAK_ELASTIC_WORKER_ID"
PREFIX_ENV = "AIAK_ELASTIC_PREFIX"
# How long a worker waits for its next world before giving up (the driver answers long
# before: it stops the job after --elastic-timeout); also HOROVOD_ELASTIC_TIMEOUT's role.
WAIT_ENV = "HOROVOD_ELASTIC_TIMEOUT"
DEFAULT_ELASTIC_TIMEOUT = 600.0


def waiting_key(prefix: str, worker: str) -> str:
    return f"{prefix}/waiting/{worker}"


def assign_key(prefix: str, worker: str, seq: int) -> str:
    return f"{prefix}/assign/{worker}/{seq}"


def updates_key(prefix: str) -> str:
    return f"{prefix}/updates"


def update_key(prefix: str, index: int) -> str:
    return f"{prefix}/update/{index}"


def world_prefix(prefix: str, round_no: int) -> str:
    """Store prefix of the Gloo rendezvous of round ``round_no`` (unique per world)."""
    return f"{prefix}/world{round_no}"


def assignment(round_no: int, rank: int, size: int, local_rank: int, local_size: int,
               cross_rank: int, cross_size: int, hostname: str, updates_seen: int = 0) -> str:
    """``updates_seen``: host-change notifications posted before this round formed (already
    reflected in it); the worker ignores them."""
    return json.dumps({"round": round_no, "rank": rank, "size": size,
                       "local_rank": local_rank, "local_size": local_size,
                       "cross_rank": cross_rank, "cross_size": cross_size,
                       "hostname": hostname, "updates_seen": updates_seen})


def stop_order(code: int, message: str) -> str:
    """Tell a worker to leave: ``code`` 0 when its host was removed (a clean exit), else the
    job failed and ``message`` says why."""
    return json.dumps({"stop": True, "code": code, "message": message})


def parse_answer(text: str) -> Dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"bad elastic driver answer {text!r}")
    return value


def parse_update(text: str) -> Optional[Tuple[int, int]]:
    stamp, _, flags = text.partition(",")
    try:
        return int(stamp), int(flags)
    except ValueError:
        return None
