"""NCCL through ctypes: communicators and the collectives the engine uses.

The library is the one ``aiakrun --check-build`` reports (the ``nvidia-nccl-cu12`` wheel that
CUDA builds of PyTorch install, or a system ``libnccl.so.2``); ``AIAK_NCCL_LIBRARY`` names a
file explicitly.  The unique id of a communicator travels over MPI.
"""
import ctypes
import math
import os
import struct
from typing import List, Optional, Tuple

from aiak_training.common.dtypes import FLOATING, DataType, ReduceOp
from aiak_training.common.gpu._loader import LazyLibrary
from aiak_training.common.host.build_info import nccl_candidates

_VOIDP = ctypes.c_void_p
_SIZE = ctypes.c_size_t
_INT = ctypes.c_int

# ncclDataType_t
INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(10)
# ncclRedOp_t
SUM, PROD, MAX, MIN, AVG = range(5)
SCALAR_HOST_IMMEDIATE = 1  # ncclScalarResidence_t
IN_PROGRESS = 7            # ncclInProgress

NCCL_DTYPE = {
    DataType.UINT8: UINT8, DataType.INT8: INT8, DataType.INT32: INT32,
    DataType.INT64: INT64, DataType.FLOAT16: FLOAT16, DataType.FLOAT32: FLOAT32,
    DataType.FLOAT64: FLOAT64, DataType.BFLOAT16: BFLOAT16,
    # bool is one byte of 0/1: or = max, and = min over uint8 (see nccl_op()).
    DataType.BOOL: UINT8,
}
_NCCL_OP = {ReduceOp.SUM: SUM, ReduceOp.AVERAGE: SUM, ReduceOp.MIN: MIN, ReduceOp.MAX: MAX,
            ReduceOp.PRODUCT: PROD}
_BOOL_OP = {ReduceOp.SUM: MAX, ReduceOp.MAX: MAX, ReduceOp.MIN: MIN, ReduceOp.PRODUCT: MIN}
_INT_SCALAR = {INT8: ctypes.c_int8, UINT8: ctypes.c_uint8, INT32: ctypes.c_int32,
               UINT32: ctypes.c_uint32, INT64: ctypes.c_int64, UINT64: ctypes.c_uint64}


def _bf16_bits(value: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF  # round to nearest even


def scalar(value: float, nccl_dtype: int):
    """``value`` as the host scalar ncclRedOpCreatePreMulSum expects for ``nccl_dtype``, or
    None if that type cannot hold it (a fractional factor for an integer type)."""
    try:
        if nccl_dtype == FLOAT64:
            return ctypes.c_double(value) if math.isfinite(value) else None
        if nccl_dtype in (FLOAT32, FLOAT16, BFLOAT16):
            # The factor must survive the narrowing as a normal, finite number; otherwise
            # the caller scales on the host instead.
            f32 = struct.unpack("<f", struct.pack("<f", value))[0]
            if nccl_dtype == FLOAT32:
                narrowed, encoded = f32, ctypes.c_float(value)
            elif nccl_dtype == FLOAT16:
                # Through float32, as Horovod's scale kernels and NCCL's own ncclAvg round
                # a factor (straight from float64 differs where float32 lands on a tie).
                bits = struct.unpack("<H", struct.pack("<e", f32))[0]
                narrowed, encoded = struct.unpack("<e", struct.pack("<H", bits))[0], \
                    ctypes.c_uint16(bits)
            else:
                bits = _bf16_bits(value)
                narrowed = struct.unpack("<f", struct.pack("<I", bits << 16))[0]
                encoded = ctypes.c_uint16(bits)
            tiny = {FLOAT32: 1.1754944e-38, FLOAT16: 6.1035156e-05, BFLOAT16: 1.1754944e-38}
            if not math.isfinite(narrowed) or abs(narrowed) < tiny[nccl_dtype]:
                return None
            return encoded
    except (OverflowError, struct.error):
        return None
    if float(value).is_integer() and nccl_dtype in _INT_SCALAR:
        return _INT_SCALAR[nccl_dtype](int(value))
    return None


def nccl_op(dtype: DataType, op: ReduceOp) -> int:
    """The NCCL op that reduces ``dtype`` with ``op`` (Average reduces as Sum)."""
    if dtype == DataType.BOOL:
        return _BOOL_OP[op]
    return _NCCL_OP[op]


def plan_reduction(dtype: DataType, op: ReduceOp, prescale: float, postscale: float,
                   size: int, version: int) -> Optional[Tuple[int, Optional[float]]]:
    """How NCCL computes ``postscale * reduce(prescale * x)`` (divided by ``size`` for
    Average) in one call: (NCCL op, pre-multiply factor or None).  None if it cannot, and
    the caller stages through MPI instead (with the CPU path's arithmetic).

    Average without other factors is ncclAvg.  Otherwise the factors fold into one
    pre-multiplied sum, ``sum_r T(f) * x_r`` with ``f = prescale * postscale (/ size)``.
    Min, Max and Product take no factors here, and integer types only integral ones (no
    Average).

    Against Horovod 0.28.1's NCCL path (a scale kernel before the reduction, ncclSum or
    ncclAvg, a scale kernel after it), bit for bit:

    * the same: no factors (Horovod's allreduce also uses ncclAvg for Average); Sum with a
      prescale only (NCCL rounds ``T(prescale) * x`` per input as Horovod's kernel does;
      the float16 factor is rounded through float32 by both); and factors whose products
      are exact (powers of two, barring overflow and subnormal results).
    * different, by about an ulp per rounding: a postscale is applied to every input
      before the sum instead of once to the sum; Average with factors rounds once where
      Horovod rounds twice (its prescale kernel, then ncclAvg's own ``T(1/size) * x``);
      reducescatter's Average is ncclAvg here, while Horovod sums and postscales by
      ``T(1/size)`` (for integers: NCCL's integer division of the sum against Horovod's
      truncated ``sum * (1.0 / size)``).  Matching those needs a scale kernel on the device.
    """
    if dtype not in NCCL_DTYPE:
        return None
    nccl_dtype = NCCL_DTYPE[dtype]
    if op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT) or dtype == DataType.BOOL:
        return (nccl_op(dtype, op), None) if prescale == 1.0 and postscale == 1.0 else None
    if op == ReduceOp.AVERAGE and prescale == 1.0 and postscale == 1.0:
        return (AVG, None) if version >= 21000 else None
    if dtype not in FLOATING and not (float(prescale).is_integer()
                                      and float(postscale).is_integer()
                                      and op != ReduceOp.AVERAGE):
        # Integers are truncated after each scaling; folding (even factors that cancel,
        # like 0.5 and 2) would skip a truncation.
        return None
    factor = prescale * postscale / (size if op == ReduceOp.AVERAGE else 1)
    if factor == 1.0:
        return SUM, None
    if version < 21100 or scalar(factor, nccl_dtype) is None:
        return None
    return SUM, factor


def supports(dtype: DataType) -> bool:
    """Whether NCCL moves ``dtype`` (int16/uint16 it does not)."""
    return dtype in NCCL_DTYPE


class NcclError(RuntimeError):
    """An NCCL call failed."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]  # NCCL_UNIQUE_ID_BYTES


_SIGNATURES = {
    "ncclGetVersion": [ctypes.POINTER(_INT)],
    "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
    "ncclCommInitRank": [ctypes.POINTER(_VOIDP), _INT, UniqueId, _INT],
    "ncclCommDestroy": [_VOIDP],
    "ncclCommAbort": [_VOIDP],
    "ncclCommGetAsyncError": [_VOIDP, ctypes.POINTER(_INT)],
    "ncclAllReduce": [_VOIDP, _VOIDP, _SIZE, _INT, _INT, _VOIDP, _VOIDP],
    "ncclBroadcast": [_VOIDP, _VOIDP, _SIZE, _INT, _INT, _VOIDP, _VOIDP],
    "ncclReduce": [_VOIDP, _VOIDP, _SIZE, _INT, _INT, _INT, _VOIDP, _VOIDP],
    "ncclAllGather": [_VOIDP, _VOIDP, _SIZE, _INT, _VOIDP, _VOIDP],
    "ncclReduceScatter": [_VOIDP, _VOIDP, _SIZE, _INT, _INT, _VOIDP, _VOIDP],
    "ncclSend": [_VOIDP, _SIZE, _INT, _INT, _VOIDP, _VOIDP],
    "ncclRecv": [_VOIDP, _SIZE, _INT, _INT, _VOIDP, _VOIDP],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
    "ncclRedOpCreatePreMulSum": [ctypes.POINTER(_INT), _VOIDP, _INT, _INT, _VOIDP],
    "ncclRedOpDestroy": [_INT, _VOIDP],
}


# Bound when present: ncclSend/ncclRecv (2.7), ncclCommGetAsyncError (2.4, always there in
# practice), ncclRedOpCreatePreMulSum/ncclRedOpDestroy (2.11).
_OPTIONAL = frozenset({"ncclSend", "ncclRecv", "ncclRedOpCreatePreMulSum", "ncclRedOpDestroy"})


class Library:
    """Checked wrappers over libnccl."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib, self.path = lib, path
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is None:
                if name in _OPTIONAL:  # older NCCL; plan_reduction and friends check versions
                    continue
                raise NcclError(f"{path} lacks {name}; NCCL >= 2.7 is needed")
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        v = _INT(0)
        self.check(lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value

    def check(self, result: int, what: str) -> None:
        if result != 0:
            text = self.lib.ncclGetErrorString(result).decode("utf-8", "replace")
            raise NcclError(f"{what} failed: {text} (ncclResult {result})")

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        # Not uid.internal: a c_char array reads as bytes up to the first NUL.
        return ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid))

    def group_start(self) -> None:
        self.check(self.lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self) -> None:
        self.check(self.lib.ncclGroupEnd(), "ncclGroupEnd")


class Communicator:
    """One NCCL communicator; every call enqueues on the ``stream`` it is given.

    Created collectively by :meth:`create` on every rank of an MPI communicator, with the
    CUDA device of this rank current.
    """

    def __init__(self, lib: Library, handle: int, size: int, rank: int):
        self.lib, self.handle, self.size, self.rank = lib, handle, size, rank
        self._h = _VOIDP(handle)

    @classmethod
    def create(cls, lib: Library, mpi_comm) -> "Communicator":
        """Collective over ``mpi_comm``: rank 0 makes the unique id, MPI broadcasts it."""
        uid_bytes = lib.unique_id() if mpi_comm.Get_rank() == 0 else None
        uid_bytes = mpi_comm.bcast(uid_bytes, root=0)
        uid = UniqueId()
        ctypes.memmove(ctypes.addressof(uid), uid_bytes, len(uid_bytes))
        handle = _VOIDP()
        size, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
        lib.check(lib.lib.ncclCommInitRank(ctypes.byref(handle), size, uid, rank),
                  f"ncclCommInitRank(size={size}, rank={rank})")
        return cls(lib, int(handle.value), size, rank)

    def async_error(self) -> Optional[str]:
        """NCCL's asynchronous error on this communicator (e.g. a peer vanished), if any."""
        result = _INT(0)
        self.lib.check(self.lib.lib.ncclCommGetAsyncError(self._h, ctypes.byref(result)),
                       "ncclCommGetAsyncError")
        if result.value in (0, IN_PROGRESS):
            return None
        return self.lib.lib.ncclGetErrorString(result.value).decode("utf-8", "replace")

    def abort(self) -> None:
        if self.handle:
            self.lib.lib.ncclCommAbort(self._h)
            self.handle, self._h = 0, _VOIDP(0)

    def destroy(self) -> None:
        if self.handle:
            self.lib.check(self.lib.lib.ncclCommDestroy(self._h), "ncclCommDestroy")
            self.handle, self._h = 0, _VOIDP(0)

    # ---- collectives ------------------------------------------------------------------
    def pre_mul_sum(self, factor: float, nccl_dtype: int) -> Optional[int]:
        """A Sum that first multiplies every input by ``factor`` (NCCL >= 2.11); None where
        NCCL cannot do it (see :func:`scalar`)."""
        value = scalar(factor, nccl_dtype)
        if value is None or self.lib.version < 21100:
            return None
        op = _INT(0)
        self.lib.check(self.lib.lib.ncclRedOpCreatePreMulSum(
            ctypes.byref(op), ctypes.byref(value), nccl_dtype, SCALAR_HOST_IMMEDIATE, self._h),
            "ncclRedOpCreatePreMulSum")
        return op.value

    def destroy_op(self, op: int) -> None:
        self.lib.check(self.lib.lib.ncclRedOpDestroy(op, self._h), "ncclRedOpDestroy")

    def allreduce(self, send: int, recv: int, count: int, dtype: int, op: int,
                  stream: int) -> None:
        self.lib.check(self.lib.lib.ncclAllReduce(_VOIDP(send), _VOIDP(recv), count, dtype, op,
                                                  self._h, _VOIDP(stream)), "ncclAllReduce")

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int,
                  stream: int) -> None:
        self.lib.check(self.lib.lib.ncclBroadcast(_VOIDP(send), _VOIDP(recv), count, dtype,
                                                  root, self._h, _VOIDP(stream)), "ncclBroadcast")

    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int,
               stream: int) -> None:
        self.lib.check(self.lib.lib.ncclReduce(_VOIDP(send), _VOIDP(recv), count, dtype, op,
                                               root, self._h, _VOIDP(stream)), "ncclReduce")

    def allgather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self.lib.check(self.lib.lib.ncclAllGather(_VOIDP(send), _VOIDP(recv), count, dtype,
                                                  self._h, _VOIDP(stream)), "ncclAllGather")

    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype: int, op: int,
                       stream: int) -> None:
        self.lib.check(self.lib.lib.ncclReduceScatter(_VOIDP(send), _VOIDP(recv), recv_count,
                                                      dtype, op, self._h, _VOIDP(stream)),
                       "ncclReduceScatter")

    def send(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self.lib.check(self.lib.lib.ncclSend(_VOIDP(buf), count, dtype, peer, self._h,
                                             _VOIDP(stream)), "ncclSend")

    def recv(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self.lib.check(self.lib.lib.ncclRecv(_VOIDP(buf), count, dtype, peer, self._h,
                                             _VOIDP(stream)), "ncclRecv")


def nccl_version_text(lib: Optional[Library]) -> str:
    """``2.32.3``, or ``unavailable``."""
    from aiak_training.common.host.build_info import nccl_version_string
    return nccl_version_string(lib.version) if lib is not None else "unavailable"


def _library_paths() -> List[str]:
    explicit = os.environ.get("AIAK_NCCL_LIBRARY")
    return [explicit] if explicit else nccl_candidates()


_library = LazyLibrary(_library_paths, Library, (NcclError,), lambda tried: NcclError(
    "NCCL could not be loaded (install nvidia-nccl-cu12, or set AIAK_NCCL_LIBRARY). "
    "Tried: " + "; ".join(tried)))


def library() -> Library:
    """The process-wide NCCL :class:`Library`; raises :class:`NcclError` if none loads."""
    return _library.get()
