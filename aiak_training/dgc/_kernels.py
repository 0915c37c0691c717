"""Threshold selection and scatter-add: the compiled kernels, with torch fallbacks.

The compiled module ``aiak_training.dgc._dgc_cpu`` (csrc/dgc/) takes raw pointers.  When it
is not built, the same results come from torch ops (the exact path: slower, identical).

Selection order (both implementations): the k elements with the largest ``|x|``, ties broken
by the smaller index; elements equal to zero (and NaN) are never selected, so a tensor with
fewer than k non-zeros yields fewer than k indices, possibly none.  Indices are returned as
int32, in ascending order.  Because the order is total, the sampled path, the exact path and
the torch fallback all return the same indices; sampling only changes the cost.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from aiak_training.common.dtypes import DataType
from aiak_training.common.once import warn_once  # noqa: F401  (re-exported)
from aiak_training.dgc.wire import parse_segments

try:
    from aiak_training.dgc import _dgc_cpu as ext  # type: ignore[attr-defined]
except ImportError as _err:  # not built: torch fallbacks below
    ext = None
    IMPORT_ERROR: Optional[BaseException] = _err
else:
    IMPORT_ERROR = None

# The dtype codes the kernels take: the shared DataType numbering (float16 only on the wire).
DTYPE_CODES = {torch.float32: int(DataType.FLOAT32), torch.float64: int(DataType.FLOAT64),
               torch.float16: int(DataType.FLOAT16)}
COMPRESSIBLE_DTYPES = (torch.float32, torch.float64)

# path codes returned by select_topk (see csrc/dgc/module.cpp)
PATH_EXACT = 0
PATH_FALLBACK = 4
PATH_TORCH = -1

def native_available() -> bool:
    """True when the compiled kernels are importable."""
    return ext is not None


def select_topk(x: torch.Tensor, k: int, *, exact: bool = False, sample_ratio: float = 0.01,
                seed: int = 0, use_native: Optional[bool] = None) -> Tuple[torch.Tensor, int]:
    """Indices of the top-``k`` elements of ``|x|`` (see the module docstring for the order).

    Args:
        x: a contiguous 1-D float32 or float64 CPU tensor.
        k: how many to select (at most; fewer if ``x`` has fewer non-zeros).
        exact: skip the sampled threshold estimate and select over the whole tensor.
        sample_ratio: fraction of elements sampled to estimate the threshold.
        seed: seeds the sample positions (the result does not depend on it).
        use_native: force (True) or forbid (False) the compiled kernel; default: use it if built.

    Returns:
        (int32 indices in ascending order, path) where path says how the kernel got there:
        0 exact, 1-3 sampled (the attempt that found enough candidates), 4 sampled then exact
        fallback, -1 torch fallback.
    """
    if x.dim() != 1 or not x.is_contiguous() or x.dtype not in COMPRESSIBLE_DTYPES:
        raise ValueError("select_topk expects a contiguous 1-D float32/float64 tensor")
    if x.device.type != "cpu":
        raise ValueError("select_topk runs on CPU tensors only")
    k = int(min(max(k, 0), x.numel()))
    native = ext is not None if use_native is None else use_native
    if native:
        if ext is None:
            raise RuntimeError(f"aiak_training.dgc._dgc_cpu is not built: {IMPORT_ERROR}")
        out = torch.empty(max(k, 1), dtype=torch.int32)
        count, path, _ = ext.select_topk(x.data_ptr(), x.numel(), DTYPE_CODES[x.dtype], k,
                                         out.data_ptr(), float(sample_ratio),
                                         int(seed) & 0xFFFFFFFFFFFFFFFF, bool(exact))
        return out[:count], int(path)
    return _select_topk_torch(x, k), PATH_TORCH


def _select_topk_torch(x: torch.Tensor, k: int) -> torch.Tensor:
    """Reference/fallback selection in torch ops, with the same order as the kernel."""
    a = x.abs()
    nonzero = a > 0  # False for NaN as well
    n_nonzero = int(nonzero.sum())
    if k <= 0 or n_nonzero == 0:
        return torch.empty(0, dtype=torch.int32)
    if n_nonzero <= k:
        return nonzero.nonzero().flatten().to(torch.int32)
    # The k-th largest value is well defined even where torch.topk's order among ties is not.
    kth = torch.topk(torch.where(nonzero, a, torch.zeros_like(a)), k, sorted=False).values.min()
    greater = (a > kth).nonzero().flatten()
    ties = (a == kth).nonzero().flatten()[: k - greater.numel()]  # smallest indices first
    return torch.sort(torch.cat([greater, ties])).values.to(torch.int32)


def compensate(g: torch.Tensor, w: Optional[torch.Tensor], u: Optional[torch.Tensor],
               v: torch.Tensor, momentum: float, dampening: float, weight_decay: float,
               nesterov: bool, first: bool, use_native: Optional[bool] = None) -> None:
    """DGC's momentum correction (paper eq. 7), in place on ``u`` and ``v``::

        g' = g + weight_decay * w
        u  = g' if first else momentum * u + (1 - dampening) * g'
        v += u                      (nesterov: v += g' + momentum * u)

    Without momentum (``u`` None) it is plain accumulation, ``v += g'``.  All tensors are
    contiguous, 1-D, of one dtype (float32/float64); ``w`` may be None when
    ``weight_decay == 0``.  The compiled kernel does it in one pass over memory.
    """
    if w is None and weight_decay != 0:
        raise ValueError("compensate: weight_decay needs w")
    native = ext is not None if use_native is None else use_native
    if native:
        if ext is None:
            raise RuntimeError(f"aiak_training.dgc._dgc_cpu is not built: {IMPORT_ERROR}")
        n = v.numel()
        for t in (g, w, u):
            if t is not None and (t.numel() != n or t.dtype != v.dtype or not t.is_contiguous()):
                raise ValueError("compensate: tensors must be contiguous, same size and dtype")
        ext.compensate(g.data_ptr(), w.data_ptr() if weight_decay != 0 else 0,
                       u.data_ptr() if u is not None else 0, v.data_ptr(), n,
                       DTYPE_CODES[v.dtype], float(momentum), float(dampening),
                       float(weight_decay), bool(nesterov), bool(first))
        return
    compensate_many([g], None if w is None else [w], None if u is None else [u], [v],
                    momentum, dampening, weight_decay, nesterov, first)


def compensate_many(gs: Sequence[torch.Tensor], ws: Optional[Sequence[torch.Tensor]],
                    us: Optional[Sequence[torch.Tensor]], vs: Sequence[torch.Tensor],
                    momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                    first: bool) -> None:
    """:func:`compensate` in torch ops for lists of tensors sharing the hyper-parameters:
    foreach ops, so one kernel launch per stage for all of them on a GPU.

    Every product is its own op, never ``add(alpha=...)``: torch fuses that into an FMA on
    some devices and not on others, and the compiled kernel rounds the product first.  So
    this gives the kernel's bits, on every device."""
    if weight_decay != 0:
        if ws is None:
            raise ValueError("compensate: weight_decay needs w")
        gs = torch._foreach_add(gs, torch._foreach_mul(ws, weight_decay))
    if us is None:
        torch._foreach_add_(vs, gs)
        return
    if first:
        torch._foreach_copy_(us, gs)
    else:
        torch._foreach_mul_(us, momentum)
        torch._foreach_add_(us, torch._foreach_mul(gs, 1.0 - dampening))
    if nesterov:
        torch._foreach_add_(vs, gs)
        torch._foreach_add_(vs, torch._foreach_mul(us, momentum))
    else:
        torch._foreach_add_(vs, us)


def compensate_select(g: torch.Tensor, w: Optional[torch.Tensor], u: Optional[torch.Tensor],
                      v: torch.Tensor, momentum: float, dampening: float, weight_decay: float,
                      nesterov: bool, first: bool, k: int, *, exact: bool = False,
                      sample_ratio: float = 0.01, seed: int = 0,
                      use_native: Optional[bool] = None) -> Tuple[torch.Tensor, int]:
    """:func:`compensate` then :func:`select_topk` on ``v``, with the same results.

    The compiled kernel fuses them: it estimates the threshold from the updated values at the
    sampled positions, then updates ``u``/``v`` block by block and scans each block while it
    is still in cache, saving a pass over ``v``.
    """
    native = ext is not None if use_native is None else use_native
    if not native:
        compensate(g, w, u, v, momentum, dampening, weight_decay, nesterov, first, use_native=False)
        return select_topk(v, k, exact=exact, use_native=False)
    if ext is None:
        raise RuntimeError(f"aiak_training.dgc._dgc_cpu is not built: {IMPORT_ERROR}")
    if w is None and weight_decay != 0:
        raise ValueError("compensate_select: weight_decay needs w")
    if v.dim() != 1 or v.dtype not in COMPRESSIBLE_DTYPES or not v.is_contiguous():
        raise ValueError("compensate_select expects contiguous 1-D float32/float64 tensors")
    n = v.numel()
    for t in (g, w, u):
        if t is not None and (t.numel() != n or t.dtype != v.dtype or not t.is_contiguous()):
            raise ValueError("compensate_select: tensors must be contiguous, same size and dtype")
    k = int(min(max(k, 0), n))
    out = torch.empty(max(k, 1), dtype=torch.int32)
    count, path, _ = ext.compensate_select(
        g.data_ptr(), w.data_ptr() if weight_decay != 0 else 0,
        u.data_ptr() if u is not None else 0, v.data_ptr(), n, DTYPE_CODES[v.dtype],
        float(momentum), float(dampening), float(weight_decay), bool(nesterov), bool(first),
        k, out.data_ptr(), float(sample_ratio), int(seed) & 0xFFFFFFFFFFFFFFFF, bool(exact))
    return out[:count], int(path)


def scatter_add_segments(buf: torch.Tensor, nranks: int, outs: Sequence[torch.Tensor],
                         wire_dtypes: Sequence[torch.dtype], scale: float = 1.0,
                         use_native: Optional[bool] = None) -> int:
    """Add every rank's pairs, times ``scale``, from an allgathered buffer into ``outs``
    (contiguous, 1-D).

    The buffer layout is documented in :mod:`aiak_training.dgc.exchange`.  Returns the number
    of pairs added.  Raises ``RuntimeError`` on a malformed buffer.
    """
    native = ext is not None if use_native is None else use_native
    if native:
        if ext is None:
            raise RuntimeError(f"aiak_training.dgc._dgc_cpu is not built: {IMPORT_ERROR}")
        return int(ext.scatter_add_segments(
            buf.data_ptr(), buf.numel(), int(nranks), [o.data_ptr() for o in outs],
            [o.numel() for o in outs], [DTYPE_CODES[o.dtype] for o in outs],
            [DTYPE_CODES[d] for d in wire_dtypes], float(scale)))
    pairs = 0
    for segment in parse_segments(buf, nranks, [o.numel() for o in outs], wire_dtypes):
        for out, (idx, vals) in zip(outs, segment):
            # index_add_ adds duplicates (scatter_ would overwrite them).
            out.index_add_(0, idx.long(), vals.to(out.dtype), alpha=scale)
            pairs += idx.numel()
    return pairs


def isa() -> str:
    """The scan implementation in use (``scalar``, ``avx2``, ``avx512``), or ``torch``."""
    return ext.isa() if ext is not None else "torch"


__all__: List[str] = ["select_topk", "scatter_add_segments", "compensate", "compensate_many",
                      "compensate_select", "native_available", "isa",
                      "warn_once", "DTYPE_CODES", "COMPRESSIBLE_DTYPES"]
