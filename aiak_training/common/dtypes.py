"""Element types and reduce ops of the engine, and their MPI counterparts.

Numbering follows Horovod's ``DataType`` / ``ReduceOp`` enums (extended with BOOL and
BFLOAT16) and is shared with ``csrc/common/dtypes.h``: every compiled extension (the engine's,
the fused optimizers', DGC's) takes these codes.  Importing this module does not import
``mpi4py.MPI`` (which initializes MPI): the fused optimizers use the codes without MPI.
"""
import functools
import warnings
from enum import IntEnum
from typing import TYPE_CHECKING, Dict, Optional

from aiak_training.common.horovod_strings import AVERAGE_DEPRECATED, OP_SUPERSEDES_AVERAGE

if TYPE_CHECKING:
    from mpi4py import MPI


class DataType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    INT32 = 4
    INT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BOOL = 9
    BFLOAT16 = 10


class ReduceOp(IntEnum):
    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


# Horovod's module-level names for the reduce ops, as plain ints, for every frontend.
Average, Sum, Adasum, Min, Max, Product = (int(op) for op in ReduceOp)


def handle_average_backwards_compatibility(op: Optional[int], average: Optional[bool]) -> int:
    """The reduce op a call asked for, from ``op`` and the deprecated ``average`` flag (every
    frontend exports this under Horovod's name)."""
    if average is None:
        return Average if op is None else op
    if op is not None:
        raise ValueError(OP_SUPERSEDES_AVERAGE)
    warnings.warn(AVERAGE_DEPRECATED, DeprecationWarning)
    return Average if average else Sum


ITEMSIZE: Dict[DataType, int] = {
    DataType.UINT8: 1, DataType.INT8: 1, DataType.UINT16: 2, DataType.INT16: 2,
    DataType.INT32: 4, DataType.INT64: 8, DataType.FLOAT16: 2, DataType.FLOAT32: 4,
    DataType.FLOAT64: 8, DataType.BOOL: 1, DataType.BFLOAT16: 2,
}

FLOATING = frozenset({DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT32, DataType.FLOAT64})
HALF_TYPES = frozenset({DataType.FLOAT16, DataType.BFLOAT16})

_user_ops: Dict[tuple, "MPI.Op"] = {}


@functools.lru_cache(maxsize=None)
def mpi_datatype(dtype: DataType) -> "MPI.Datatype":
    from mpi4py import MPI
    return {
        DataType.UINT8: MPI.UINT8_T, DataType.INT8: MPI.INT8_T, DataType.UINT16: MPI.UINT16_T,
        DataType.INT16: MPI.INT16_T, DataType.INT32: MPI.INT32_T, DataType.INT64: MPI.INT64_T,
        # Half types travel as 16-bit words and are reduced by our own kernels (user ops).
        DataType.FLOAT16: MPI.UINT16_T, DataType.BFLOAT16: MPI.UINT16_T,
        DataType.FLOAT32: MPI.FLOAT, DataType.FLOAT64: MPI.DOUBLE, DataType.BOOL: MPI.C_BOOL,
    }[dtype]


class _HalfOp:
    """Stands in for a half-type user op where MPI is not initialized (the Gloo transport
    reduces half types itself; it only needs to know which type and op, see
    :func:`user_op_key`)."""

    def Free(self) -> None:
        pass


def _make_user_op(dtype: DataType, op: ReduceOp) -> "MPI.Op":
    from mpi4py import MPI
    from aiak_training.common import native
    if not MPI.Is_initialized():
        return _HalfOp()

    def reduce_fn(inbuf, inoutbuf, datatype):
        count = len(inbuf) // ITEMSIZE[dtype]
        native.reduce(inbuf.address, inoutbuf.address, count, int(dtype), int(op))

    return MPI.Op.Create(reduce_fn, commute=True)


@functools.lru_cache(maxsize=None)
def _builtin_ops() -> tuple:
    """(ops by ReduceOp, logical ops for bool by ReduceOp)."""
    from mpi4py import MPI
    return ({ReduceOp.AVERAGE: MPI.SUM, ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN,
             ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD},
            {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND,
             ReduceOp.PRODUCT: MPI.LAND})


def mpi_op(dtype: DataType, op: ReduceOp) -> "MPI.Op":
    """The MPI op that reduces ``dtype`` with ``op`` (Average reduces as Sum)."""
    ops, bool_ops = _builtin_ops()
    if dtype == DataType.BOOL:
        if op not in bool_ops:
            raise ValueError(f"Reduce op {op.name} is not supported for bool tensors.")
        return bool_ops[op]
    if dtype in HALF_TYPES:
        key = (dtype, ReduceOp.SUM if op == ReduceOp.AVERAGE else op)
        if key not in _user_ops:
            _user_ops[key] = _make_user_op(*key)
        return _user_ops[key]
    return ops[op]


def user_op_key(op: object) -> Optional[tuple]:
    """(DataType, ReduceOp) of an op made by :func:`mpi_op` for a half type, else None."""
    for key, made in _user_ops.items():
        if made is op:
            return key
    return None


def free_user_ops() -> None:
    from mpi4py import MPI
    for op in _user_ops.values():
        try:
            op.Free()
        except MPI.Exception:
            pass
    _user_ops.clear()
