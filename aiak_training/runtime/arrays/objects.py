"""Picklable Python objects moved between ranks, for any frontend.

An object travels as its cloudpickle bytes in one allgather of uint8 arrays.  Contributions
may differ in length, so nobody has to learn a byte count in a separate step first; a
broadcast is an allgather to which only the root contributes.
"""
import io
from typing import Any, List

import cloudpickle
import numpy as np

from aiak_training.runtime import current
from aiak_training.runtime.arrays import array_ops
from aiak_training.runtime.sets.process_sets import ProcessSet


def _gathered_bytes(payload: bytes, name: str, process_set: ProcessSet) -> bytes:
    data = np.frombuffer(payload, dtype=np.uint8) if payload else np.empty(0, np.uint8)
    (gathered,) = array_ops.allgather([data], array_ops.Names(name, name), process_set)
    return gathered.tobytes()


def broadcast_object(obj: Any, root_rank: int, name: str, process_set: ProcessSet) -> Any:
    """``root_rank``'s ``obj`` on every member of ``process_set``: the object itself on the
    root, an unpickled copy elsewhere.  ``name`` must agree across the members."""
    is_root = current.topology().rank == root_rank
    data = _gathered_bytes(cloudpickle.dumps(obj) if is_root else b"", name, process_set)
    if not data:
        # Nobody contributed, so every member raises here alike.
        raise ValueError(f"broadcast_object: root_rank {root_rank} is not a member of "
                         f"{process_set}.")
    return obj if is_root else cloudpickle.loads(data)


def allgather_object(obj: Any, name: str, process_set: ProcessSet) -> List[Any]:
    """Every member's ``obj``, in rank order (unpickled copies, this rank's too)."""
    data = _gathered_bytes(cloudpickle.dumps(obj), name, process_set)
    stream = io.BytesIO(data)
    # Each pickle ends with its own STOP opcode, so they are read back one after another
    # until the bytes run out.  Counting them needs no engine query: by now a faster peer
    # may have shut the job down, and this rank's engine with it.
    objects = []
    while stream.tell() < len(data):
        objects.append(cloudpickle.load(stream))
    return objects
