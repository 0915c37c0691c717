"""Collectives on numpy arrays: the framework-neutral half of a frontend.

A frontend that can show its tensors as numpy arrays (without a copy, where the framework
allows it) passes them here and wraps the arrays that come back.  Everything a collective
needs from the engine is settled in this module: the element type, the operation's name,
this rank's place in the process set, the broadcast root and the alltoall splits, and the
memory of the results.  A frontend therefore only converts tensors and adds its own
semantics (gradients, sparse tensors, compression).

Results are new C-contiguous arrays aligned to :data:`ALIGN` bytes, so frameworks that
assume aligned buffers (TensorFlow's Eigen kernels) can take them over as they are; large
ones reuse the memory of results that are gone (``array_pool``).
Every function here blocks until the operation is done; a grouped call submits all its
arrays in one step, so the engine can fuse them.
"""
import itertools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from aiak_training.allreduce import adasum as _adasum
from aiak_training.common.dtypes import DataType, ReduceOp
from aiak_training.common.horovod_strings import TENSOR_TYPE_NOT_SUPPORTED
from aiak_training.common.messages import OpType, Request
from aiak_training.runtime import current
from aiak_training.runtime.arrays import array_pool
from aiak_training.runtime.arrays.array_pool import ALIGN  # noqa: F401 - re-exported
from aiak_training.runtime.entries import TensorEntry
from aiak_training.runtime.engine import Engine
from aiak_training.runtime.sets.process_sets import ProcessSet


# numpy's names of the element types the engine moves (bfloat16 is ml_dtypes' type).
_BY_NAME: Dict[str, DataType] = {
    "uint8": DataType.UINT8, "int8": DataType.INT8, "uint16": DataType.UINT16,
    "int16": DataType.INT16, "int32": DataType.INT32, "int64": DataType.INT64,
    "float16": DataType.FLOAT16, "bfloat16": DataType.BFLOAT16,
    "float32": DataType.FLOAT32, "float64": DataType.FLOAT64, "bool": DataType.BOOL,
}
_REDUCE_OPS = {int(op): op for op in ReduceOp}


def data_type(dtype: Any) -> Optional[DataType]:
    """The engine's element type for a numpy dtype (or its name); None if unsupported."""
    return _BY_NAME.get(np.dtype(dtype).name if not isinstance(dtype, str) else dtype)


def check_data_type(dtype: Any, what: str = "") -> DataType:
    """:func:`data_type`, raising Horovod's ``ValueError`` (naming ``what``) when the engine
    cannot move that type."""
    try:
        found = data_type(dtype)
    except TypeError:  # not a numpy dtype at all (a string tensor's object type, ...)
        found = None
    if found is None:
        detail = f" ({what})" if what else ""
        raise ValueError(TENSOR_TYPE_NOT_SUPPORTED.format(dtype) + detail)
    return found


def check_reduce_op(op: int, dtype: DataType, adasum: bool = False) -> ReduceOp:
    """The ReduceOp for ``op``, refused where the engine cannot apply it to ``dtype``.
    ``adasum``: the caller is an allreduce, the one collective Adasum applies to."""
    try:
        rop = _REDUCE_OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown reduce op {op!r}.") from None
    if rop == ReduceOp.ADASUM:
        if not adasum:
            refuse_adasum_reducescatter(rop)
        _adasum.check_dtype(dtype)
    if dtype == DataType.BOOL and rop == ReduceOp.AVERAGE:
        raise ValueError("Average is not supported for bool tensors; use Sum/Max (logical or) "
                         "or Min/Product (logical and).")
    return rop


def empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous result array aligned to :data:`ALIGN` bytes (large
    ones from the reuse pool, see ``array_pool``)."""
    return array_pool.pool.empty(shape, dtype)


# ---- names ----------------------------------------------------------------------------------
# Generated names count per process set: they need to agree among a set's members only.
_counters: Dict[int, "itertools.count"] = {}
_counters_lock = threading.Lock()


def reset_names() -> None:
    """Restart the generated names (called by ``init``, so a restarted job agrees again)."""
    with _counters_lock:
        _counters.clear()


class Names:
    """What the tensors of one submission are called.

    ``base`` is the full name of a single tensor (the base of a group's names, which get
    ``_0``, ``_1``, ... appended).  Without one, ``<prefix>.noname.<n>`` is generated from a
    per-set counter when the submission is known to be valid, so that ranks on which a call
    fails alike still agree on the next generated name.
    """

    def __init__(self, prefix: str, base: Optional[str] = None, grouped: bool = False):
        self.prefix, self.base, self.grouped = prefix, base, grouped

    def resolve(self, count: int, set_id: int) -> List[str]:
        base = self.base
        if not base:
            with _counters_lock:
                counter = _counters.setdefault(set_id, itertools.count())
                base = f"{self.prefix}.noname.{next(counter)}"
        if not self.grouped:
            return [base]
        return [f"{base}_{i}" for i in range(count)]


# ---- process sets ---------------------------------------------------------------------------
def set_rank(process_set: ProcessSet, engine: Optional[Engine] = None) -> int:
    """This process's rank in ``process_set``; ``ValueError`` if it is not a member.
    ``engine``: the running engine, when the caller already holds it."""
    engine = engine or current.engine()
    sid = process_set.process_set_id
    if sid is None:
        raise ValueError(f"{process_set} has not been registered (hvd.add_process_set).")
    rank = engine.rank_in_set(sid)
    if rank is not None:
        return rank
    ranks, _, rank = engine.process_set_info(sid)  # raises for an unknown set
    if rank is None:
        raise ValueError(f"Rank {engine.topology.rank} is not part of {process_set}; only its "
                         f"members {ranks} may run collectives on it.")
    return rank


def set_size(process_set: ProcessSet) -> int:
    """How many ranks ``process_set`` has (it must be registered)."""
    sid = process_set.process_set_id
    if sid is None:
        raise ValueError(f"{process_set} has not been registered (hvd.add_process_set).")
    return current.engine().process_set_info(sid)[1]


def root_index(process_set: ProcessSet, root_rank: int) -> int:
    """Where global rank ``root_rank`` sits in ``process_set``; ``ValueError`` if nowhere."""
    ranks = current.engine().process_set_info(process_set.process_set_id)[0]
    if root_rank not in ranks:
        raise ValueError(f"broadcast root_rank {root_rank} is not a member of {process_set} "
                         f"(ranks {ranks}).")
    return ranks.index(root_rank)


# ---- submission -----------------------------------------------------------------------------
def _run(op_type: OpType, arrays: Sequence[np.ndarray], names: Names,
         process_set: ProcessSet, outputs: Optional[List[Optional[np.ndarray]]] = None,
         **fields) -> Tuple[List[Optional[np.ndarray]], List[Any]]:
    """Submit one request per array as a single step, wait for all of them, and return
    (output arrays, the engine's per-tensor results).  ``outputs`` entries that are None
    are allocated once negotiation has fixed their shape."""
    if not arrays:
        raise ValueError("Expected at least one tensor.")
    engine = current.engine()
    rank = set_rank(process_set)
    srcs = [np.ascontiguousarray(a) for a in arrays]
    types = [check_data_type(a.dtype) for a in srcs]  # all valid before a name is drawn
    outs: List[Optional[np.ndarray]] = list(outputs) if outputs is not None else [None] * len(srcs)
    resolved = names.resolve(len(srcs), process_set.process_set_id)
    requests, entries = [], []
    for i, (src, name, dt) in enumerate(zip(srcs, resolved, types)):
        shape = tuple(src.shape)
        out = outs[i]
        requests.append(Request(rank, name, op_type, int(dt), shape, **fields))
        entries.append(TensorEntry(name, dt, shape, src.ctypes.data,
                                   out.ctypes.data if out is not None else 0,
                                   None if out is not None else _allocator(outs, i, src.dtype),
                                   keep=(src, outs)))
    handles = engine.enqueue(process_set.process_set_id, requests, entries)
    results = []
    failure: Optional[BaseException] = None
    for handle in handles:  # wait for every handle, so none is left behind on an error
        try:
            results.append(engine.wait(handle).result)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failure = failure or exc
            results.append(None)
    if failure is not None:
        raise failure
    return outs, results


def _allocator(outs: List[Optional[np.ndarray]], index: int,
               dtype: np.dtype) -> Callable[[Tuple[int, ...]], int]:
    def allocate(shape: Tuple[int, ...]) -> int:
        outs[index] = empty(shape, dtype)
        return outs[index].ctypes.data
    return allocate


def _checked_op(op: int, arrays: Sequence[np.ndarray], adasum: bool = False) -> int:
    """``op`` as the engine's code, once every array's type accepts it."""
    for a in arrays:
        check_reduce_op(op, check_data_type(np.asarray(a).dtype), adasum)
    return int(op)


def check_adasum_set(process_set: ProcessSet) -> None:
    """Horovod's limits on where Adasum runs: the global set, of a power-of-two size."""
    _adasum.check_ranks(set_size(process_set), process_set.process_set_id == 0)


def check_adasum_dtype(dtype: DataType, shown: Any = None) -> None:
    """``ValueError`` naming the type (``shown``: the framework's name for it) unless
    Adasum can combine it (float16, bfloat16, float32, float64)."""
    _adasum.check_dtype(dtype, shown)


def refuse_adasum_reducescatter(op: Any) -> None:
    """Horovod's ``NotImplementedError`` (a ``RuntimeError``) for a reducescatter asked to
    use Adasum.  Every frontend calls this before it looks at the tensors, so the error is
    the same whatever their dtype: code that catches ``RuntimeError`` there keeps working
    for integer tensors too, which Adasum's own dtype check would refuse with a
    ``ValueError``."""
    if op == ReduceOp.ADASUM:
        raise NotImplementedError(_adasum.NOT_FOR_REDUCESCATTER)


def allreduce(arrays: Sequence[np.ndarray], names: Names, op: int,
              process_set: ProcessSet, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0) -> List[np.ndarray]:
    """Reduce each array over ``process_set`` with ``op`` (a ``ReduceOp`` value); new
    arrays of the same shapes and dtypes, in order."""
    rop = _checked_op(op, arrays, adasum=True)
    if rop == ReduceOp.ADASUM:
        check_adasum_set(process_set)
    if not arrays:
        raise ValueError("Expected at least one tensor.")
    # The torch frontend's path for several tensors: one list per field, one wait for all.
    engine = current.engine()
    rank = set_rank(process_set)
    srcs = [np.ascontiguousarray(a) for a in arrays]
    types = [int(check_data_type(a.dtype)) for a in srcs]  # all valid before a name is drawn
    # ascontiguousarray makes a 0-d array 1-d: the shapes are the arrays' own.
    shapes = [np.shape(a) for a in arrays]
    outputs = [empty(shape, a.dtype) for shape, a in zip(shapes, srcs)]
    set_id = process_set.process_set_id
    handles = engine.submit_allreduces(
        set_id, rank, names.resolve(len(srcs), set_id), types, shapes,
        [a.ctypes.data for a in srcs], [o.ctypes.data for o in outputs], int(rop),
        float(prescale_factor), float(postscale_factor), (srcs, outputs))
    engine.wait_all(handles)
    return outputs


def allgather(arrays: Sequence[np.ndarray], names: Names,
              process_set: ProcessSet) -> List[np.ndarray]:
    """Concatenate each array along dimension 0 over the members, in rank order."""
    for a in arrays:
        if np.ndim(a) == 0:
            raise ValueError("allgather requires tensors of rank >= 1 (got a scalar).")
    outs, _ = _run(OpType.ALLGATHER, arrays, names, process_set)
    return outs


def broadcast(arrays: Sequence[np.ndarray], root_rank: int, names: Names,
              process_set: ProcessSet) -> List[np.ndarray]:
    """``root_rank``'s arrays (``root_rank`` is a global rank in ``process_set``)."""
    set_rank(process_set)
    root = root_index(process_set, root_rank)
    outputs = [empty(np.shape(a), np.asarray(a).dtype) for a in arrays]
    outs, _ = _run(OpType.BROADCAST, arrays, names, process_set, outputs, root=root)
    return outs


def alltoall_splits(rows: int, splits: Optional[Sequence[int]], members: int) -> List[int]:
    """The rows sent to each member: ``splits`` checked, or an even deal without them."""
    if splits is None:
        if rows % members != 0:
            raise ValueError(f"alltoall: tensor dimension 0 ({rows}) is not divisible by the "
                             f"number of processes ({members}); pass splits explicitly.")
        return [rows // members] * members
    split_list = [int(s) for s in np.asarray(splits).reshape(-1)]
    if len(split_list) != members:
        raise ValueError(f"alltoall: splits has {len(split_list)} entries; expected one per "
                         f"process ({members}).")
    if any(s < 0 for s in split_list):
        raise ValueError("alltoall: splits must be non-negative.")
    if sum(split_list) > rows:
        raise ValueError(f"alltoall: sum of splits ({sum(split_list)}) exceeds tensor "
                         f"dimension 0 ({rows}).")
    return split_list


def alltoall(array: np.ndarray, splits: Optional[Sequence[int]], names: Names,
             process_set: ProcessSet) -> Tuple[np.ndarray, np.ndarray]:
    """Send ``splits[i]`` rows (dimension 0) to member ``i``; returns the rows received,
    concatenated in rank order, and an int32 array of how many came from each member."""
    if np.ndim(array) == 0:
        raise ValueError("alltoall requires a tensor of rank >= 1 (got a scalar).")
    set_rank(process_set)
    split_list = alltoall_splits(np.shape(array)[0], splits, set_size(process_set))
    outs, results = _run(OpType.ALLTOALL, [array], names, process_set,
                         splits=tuple(split_list))
    _, received = results[0]
    return outs[0], np.asarray(received, dtype=np.int32)


def reducescatter(arrays: Sequence[np.ndarray], names: Names, op: int,
                  process_set: ProcessSet, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> List[np.ndarray]:
    """Reduce each array over the members with ``op``; each member keeps its block of rows
    (rank order; the lowest ranks get one extra row when they do not divide evenly)."""
    refuse_adasum_reducescatter(op)
    rop = _checked_op(op, arrays)
    for a in arrays:
        if np.ndim(a) == 0:
            raise ValueError("reducescatter requires a tensor of rank >= 1 (got a scalar).")
    outs, _ = _run(OpType.REDUCESCATTER, arrays, names, process_set, reduce_op=rop,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))
    return outs


def join() -> int:
    """Wait until every rank has joined (contributing zeros meanwhile); the last one."""
    return int(current.engine().run_control(0, OpType.JOIN, "join"))


def barrier(process_set: ProcessSet) -> None:
    """Wait until every member of ``process_set`` has called barrier."""
    set_rank(process_set)
    current.engine().run_control(process_set.process_set_id, OpType.BARRIER, "barrier")
