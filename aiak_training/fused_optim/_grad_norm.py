"""The global L2 norm of many gradients, from tensors or from a launch plan's tables.

LAMB clips with the norm of every gradient of every param group.  The unplanned path hands
tensors (:func:`global_grad_norm`); a cached plan (``_plan.Plan``) already holds the gradients'
addresses per (dtype, master) bucket, so :class:`NormParts` takes those tables as they are and
the step needs no per-gradient Python.  Both feed the same reduction, in the same order:

* per device, in order of first appearance, a float64 partial sum;
* inside it, per dtype (first appearance), the kernel sums of the tensors the kernels can walk
  (CPU: one float64 sum per tensor, added with ``math.fsum``, exactly rounded whatever the
  order; CUDA: one call over every such tensor of the dtype, in parameter order), then torch
  ops for the others.

So a planned step and an unplanned one give the same bits.
"""
from __future__ import annotations

import ctypes
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _backend as B
from . import _plan as P

# CPU: (addresses, numels); CUDA: (pointer array, int64 numels array, count).
Table = Tuple


class NormParts:
    """Gradients to reduce, gathered per (device, dtype) in first-appearance order."""

    def __init__(self) -> None:
        self.tables: Dict[Tuple[torch.device, torch.dtype], List[Table]] = {}
        self.other: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = {}

    def _key(self, device: torch.device, dtype: torch.dtype) -> Tuple[torch.device, torch.dtype]:
        key = (device, dtype)
        if key not in self.tables:
            self.tables[key] = []
            self.other[key] = []
        return key

    def add_plan(self, plan: "P.Plan") -> None:
        """Every gradient of a plan: its buckets' gradient tables, no per-tensor work."""
        for b in plan.buckets:
            key = self._key(plan.device, b.dtype)
            if plan.cuda:
                self.tables[key].append((b.arrays["grads"], b.c_numels, len(b.numels)))
            else:
                self.tables[key].append((b.tables["grads"], b.numels))

    def add_tensors(self, grads: Sequence[Tensor]) -> None:
        """Gradients given as tensors (the unplanned path, or a functional call)."""
        for device, dtype in dict.fromkeys((g.device, g.dtype) for g in grads):
            key = self._key(device, dtype)
            ts = [g for g in grads if g.device == device and g.dtype == dtype]
            walkable = ([t for t in ts if B.kernel_friendly([t])]
                        if P.kernels_ready(device) else [])
            if walkable:
                if P.uses_cuda_tables(device):
                    self.tables[key].append((B.ptr_array(walkable),
                                             B.int64_array([t.numel() for t in walkable]),
                                             len(walkable)))
                else:
                    self.tables[key].append(([t.data_ptr() for t in walkable],
                                             [t.numel() for t in walkable]))
            taken = set(map(id, walkable))
            self.other[key].extend(t for t in ts if id(t) not in taken)

    def __bool__(self) -> bool:
        return bool(self.tables)

    def norm(self, grad_scale: Optional[Tensor] = None) -> Optional[Tensor]:
        """The L2 norm (unscaled by ``grad_scale``) as a float64 scalar on the first device."""
        if not self.tables:
            return None
        per_device: Dict[torch.device, Tensor] = {}
        for (device, dtype), tables in self.tables.items():
            part = per_device.get(device)
            if part is None:
                part = per_device[device] = torch.zeros((), dtype=torch.float64, device=device)
            if tables:
                part += _kernel_sum(device, dtype, tables)
            for t in self.other[(device, dtype)]:
                part += t.double().pow(2).sum()
        target = next(iter(per_device))
        total = torch.zeros((), dtype=torch.float64, device=target)
        for part in per_device.values():
            total += part.to(target)
        norm = total.sqrt()
        if grad_scale is not None:
            norm = norm / grad_scale.to(device=target, dtype=torch.float64)
        return norm


def _kernel_sum(device: torch.device, dtype: torch.dtype, tables: List[Table]) -> Union[float, Tensor]:
    """Sum of squares of the tables' tensors: a Python float (CPU) or a float64 tensor (CUDA)."""
    code = B.DTYPE_CODES[dtype]
    if not P.uses_cuda_tables(device):
        threads = B.num_threads()
        sums: List[float] = []
        for addrs, numels in tables:
            sums.extend(B.cpu_ext.sum_squares(addrs, numels, code, threads))
        return math.fsum(sums)
    if len(tables) == 1:
        ptrs, numels, n = tables[0]
    else:  # several param groups: one call over all of them, in parameter order
        n = sum(t[2] for t in tables)
        ptrs, numels = (ctypes.c_void_p * n)(), (ctypes.c_int64 * n)()
        at = 0
        for arr, nums, k in tables:
            ptrs[at:at + k] = arr[:k]
            numels[at:at + k] = nums[:k]
            at += k
    lib = B.cuda_lib()
    out = torch.zeros((), dtype=torch.float32, device=device)
    ws = torch.empty(int(lib.aiak_fused_lamb_cuda_workspace_bytes(n, numels)),
                     dtype=torch.uint8, device=device)
    with torch.cuda.device(device):
        rc = lib.aiak_fused_sum_squares_cuda(n, numels, ptrs, code, out.data_ptr(),
                                             ws.data_ptr(), B.cuda_stream(device))
    B.check_cuda(rc, "aiak_fused_sum_squares_cuda")
    return out.double()


def global_grad_norm(grads: Sequence[Tensor], grad_scale: Optional[Tensor] = None) -> Optional[Tensor]:
    """L2 norm of all gradients (unscaled by ``grad_scale``), as a float64 scalar tensor on the
    first gradient's device.  Dense CPU and CUDA gradients go through the fused kernels (in a
    fixed order); the others through torch ops."""
    if not grads:
        return None
    parts = NormParts()
    parts.add_tensors(grads)
    return parts.norm(grad_scale)
