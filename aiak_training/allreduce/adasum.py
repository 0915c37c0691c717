"""adasum: Horovod's Adasum reduction (``op=hvd.Adasum``) on host memory.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021)
combines two gradients ``a`` and ``b`` as::

    a' = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so components the two share are averaged and orthogonal components are added.  Over ``2^k``
ranks it is applied as a binary tree: at level 1 ranks ``2i`` and ``2i+1`` combine, at level 2
the results of ``{0,1}`` and ``{2,3}``, and so on.

Communication is vector halving, distance doubling, as in Horovod's CPU Adasum
(``horovod/common/ops/adasum/adasum.h``, flat on the global communicator):

* at level ``l`` (1, 2, 4, ...) a rank pairs with ``rank ^ l``; the pair hold the same range
  of the buffer, the lower rank keeps its first half and the upper rank the second, and each
  sends its partner the half the partner keeps;
* each rank computes, per tensor, ``a.b``, ``|left|^2`` and ``|right|^2`` of its half
  (float64), and sums them over the ``2l`` ranks whose halves together make up the whole of
  both operands (one small allreduce per level), so every rank combines with full-tensor
  coefficients;
* the halves are then put back together in the reverse order (distance doubling).

Each rank moves about as many bytes as a ring allreduce, plus ``3 * tensors`` doubles per
level.  A fused buffer keeps per-tensor coefficients: the dot products are taken per tensor
over the part of each tensor that falls in a rank's range.  As in Horovod, a tensor whose
squared norm is below 1e-8 gets coefficient 1 (it is added, not divided by ~0).

The arithmetic (dot products in float64, the scaled add) is C++ (``csrc/adasum/``, AVX2 and
AVX-512 with run-time dispatch); this module only moves data.
"""
from typing import List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from aiak_training.common import horovod_strings as hs
from aiak_training.common.dtypes import ITEMSIZE, DataType
from aiak_training.common.topology import Topology

#: Element types Adasum combines; Horovod has float16/32/64, bfloat16 is ours.
ADASUM_TYPES = frozenset({DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT32,
                          DataType.FLOAT64})

_TAG = 0x5AD

NOT_FOR_REDUCESCATTER = (
    "Adasum is an allreduce: reducescatter takes Sum, Average, Min, Max or Product.")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_dtype(dtype: DataType, shown: Optional[object] = None) -> None:
    """Refuse an element type Adasum cannot combine (integers, bool): the dot products and
    coefficients only mean something for floating point.  ``shown`` is the framework's
    name for the type, used in the message."""
    if DataType(dtype) not in ADASUM_TYPES:
        name = shown if shown is not None else DataType(dtype).name.lower()
        raise ValueError(f"Adasum supports float16, bfloat16, float32 and float64 tensors; got "
                         f"a tensor of type {name}.")


def check_ranks(size: int, is_global: bool) -> None:
    """Horovod's restrictions on where Adasum runs, with its errors: the global process set
    only, and (on CPU) a power-of-two number of ranks."""
    if not is_global:
        raise NotImplementedError(hs.ADASUM_PROCESS_SETS)
    if not is_power_of_two(size):
        raise NotImplementedError(hs.ADASUM_NON_POWER_OF_2)


def _kernels():
    from aiak_training.allreduce import _adasum_cpu  # the compiled half (csrc/adasum/)
    return _adasum_cpu


def _mem(addr: int, nbytes: int) -> list:
    return [MPI.buffer.fromaddress(addr, nbytes), MPI.BYTE]


class Adasum:
    """Adasum over ``comm`` (a power-of-two number of ranks).  Collective to construct (it
    duplicates ``comm``, so its point-to-point messages cannot meet anyone else's, and splits
    one communicator per level for the dot products); ``close()`` is collective too."""

    def __init__(self, comm: MPI.Comm) -> None:
        size = comm.Get_size()
        if not is_power_of_two(size):
            raise NotImplementedError(hs.ADASUM_NON_POWER_OF_2)
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), size
        # level_comms[k]: the 2^(k+1) ranks that together hold both operands of level 2^k.
        self.level_comms: List[MPI.Comm] = []
        level = 1
        while level < size:
            if 2 * level == size:
                self.level_comms.append(self.comm)
            else:
                self.level_comms.append(self.comm.Split(color=self.rank // (2 * level),
                                                        key=self.rank))
            level *= 2
        self._scratch = np.empty(0, dtype=np.uint8)
        self._sums = np.empty(0, dtype=np.float64)
        self._k = _kernels()

    def _scratch_addr(self, nbytes: int) -> int:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 2 * self._scratch.nbytes), dtype=np.uint8)
        return self._scratch.ctypes.data

    def __call__(self, addr: int, counts: Sequence[int], dtype: DataType) -> None:
        """Combine, in place, the ``sum(counts)`` elements of ``dtype`` at ``addr``: the
        tensors of ``counts`` laid end to end, each with its own coefficients."""
        check_dtype(dtype)
        counts = [int(c) for c in counts]
        total = sum(counts)
        if self.size == 1 or total == 0:
            return
        item = ITEMSIZE[dtype]
        code = int(dtype)
        bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        if self._sums.size < 3 * len(counts):
            self._sums = np.empty(3 * len(counts), dtype=np.float64)
        sums = self._sums[:3 * len(counts)]
        scratch = self._scratch_addr((total - total // 2) * item)
        comm, rank, k = self.comm, self.rank, self._k
        lo, hi = 0, total
        ranges = []
        level, index = 1, 0
        # Vector halving: each level keeps half of the range and combines it.
        while level < self.size:
            partner = rank ^ level
            first = (hi - lo) // 2
            lower = rank & level == 0
            keep, give = ((lo, lo + first), (lo + first, hi)) if lower else \
                ((lo + first, hi), (lo, lo + first))
            ranges.append((lo, hi))
            n_keep = keep[1] - keep[0]
            comm.Sendrecv(_mem(addr + give[0] * item, (give[1] - give[0]) * item), partner, _TAG,
                          _mem(scratch, n_keep * item), partner, _TAG)
            # Each tensor's share of the kept range (0 for tensors wholly outside it).
            seg = np.clip(np.minimum(bounds[1:], keep[1]) - np.maximum(bounds[:-1], keep[0]),
                          0, None).tolist()
            mine = addr + keep[0] * item
            # [a.b, |left|^2, |right|^2] per tensor, "left" being the lower rank's operand,
            # so both partners add their partial sums into the same slots.
            k.segment_dots(mine, scratch, seg, code, sums.ctypes.data, lower)
            self.level_comms[index].Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
            k.segment_combine(mine, scratch, seg, code, sums.ctypes.data, lower)
            lo, hi = keep
            level *= 2
            index += 1
        # Distance doubling: put the halves back together, last level first.
        level //= 2
        while ranges:
            plo, phi = ranges.pop()
            partner = rank ^ level
            other = (hi, phi) if rank & level == 0 else (plo, lo)
            comm.Sendrecv(_mem(addr + lo * item, (hi - lo) * item), partner, _TAG,
                          _mem(addr + other[0] * item, (other[1] - other[0]) * item), partner,
                          _TAG)
            lo, hi = plo, phi
            level //= 2

    def close(self) -> None:
        for c in self.level_comms:
            if c is not self.comm and c != MPI.COMM_NULL:
                c.Free()
        self.level_comms = []
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def adasum_allreduce(topology: Topology, addr: int, counts: Sequence[int],
                     dtype: DataType) -> None:
    """Adasum of the tensors (``counts`` elements each, end to end at ``addr``) over
    ``topology.comm``, in place.  The communicators are made on first use and kept with the
    topology (freed by ``topology.free()``); the engine runs Adasum responses in the same
    order on every rank, so that first use is collective."""
    algo = getattr(topology, "_aiak_adasum", None)
    if algo is None:
        algo = Adasum(topology.comm)
        topology._aiak_adasum = algo
        topology.add_finalizer(algo.close)
    algo(addr, counts, dtype)
