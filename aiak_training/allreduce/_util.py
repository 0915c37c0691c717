"""Small helpers shared by the allreduce algorithms: raw-memory MPI buffers, env settings."""
import os
from typing import Optional

from mpi4py import MPI

from aiak_training.common.dtypes import ITEMSIZE, DataType, mpi_datatype


def mpi_buf(addr: int, count: int, dtype: DataType, blocks: int = 1) -> list:
    """An mpi4py buffer spec for ``blocks`` x ``count`` elements of ``dtype`` at raw address
    ``addr``; ``count`` is what MPI receives as the count (per rank for the *_block and
    gather collectives, where ``blocks`` is the communicator size)."""
    nbytes = blocks * count * ITEMSIZE[dtype]
    return [MPI.buffer.fromaddress(addr, nbytes), count, mpi_datatype(dtype)]


def env_bytes(name: str, default: int, minimum: int = 0) -> int:
    """A byte count from the environment; accepts plain integers and K/M/G(iB) suffixes."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = parse_bytes(raw)
    if value is None or value < minimum:
        raise ValueError(f"{name}={raw!r}: expected a byte count >= {minimum} "
                         "(e.g. 4194304, 4M or 4MiB).")
    return value


def env_float(name: str, default: float, minimum: float = 0.0) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: expected a number >= {minimum}.")
    return value


_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024 ** 2, "mb": 1024 ** 2,
          "mib": 1024 ** 2, "g": 1024 ** 3, "gb": 1024 ** 3, "gib": 1024 ** 3}


def parse_bytes(text: str) -> Optional[int]:
    """'4194304', '4M', '4MiB', '512k' -> bytes (binary units); None if malformed."""
    s = text.strip().lower()
    i = len(s)
    while i and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    number, unit = s[:i], s[i:].strip()
    if unit not in _UNITS or not number:
        return None
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        return None
