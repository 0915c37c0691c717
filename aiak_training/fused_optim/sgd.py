"""FusedSGD: drop-in replacement for torch.optim.SGD (momentum, dampening, nesterov, weight
decay, maximize).  Same layout as adam.py: a single-tensor reference path in torch ops and a
fused multi-tensor path, side by side, behind the functional :func:`fused_sgd`."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _backend as B
from . import _plan as P
from ._base import FusedOptimizerBase, to_float

__all__ = ["FusedSGD", "fused_sgd"]


def _single_tensor_sgd(
    params: List[Tensor], grads: List[Tensor], momentum_buffers: List[Optional[Tensor]],
    master_params: List[Optional[Tensor]], first_step: List[bool], *, weight_decay: float,
    momentum: float, lr: float, dampening: float, nesterov: bool, maximize: bool,
    inv_scale: Optional[float],
) -> None:
    """Reference SGD, one tensor at a time (mirrors torch.optim's for-loop path)."""
    for i, param in enumerate(params):
        grad, master = grads[i], master_params[i]
        opmath = B.state_dtype(param.dtype)
        if inv_scale is not None:
            grad.copy_(grad.to(opmath) * inv_scale)
        g = grad.to(opmath)
        if maximize:
            g = -g
        p = master if master is not None else param.to(opmath)
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffers[i]
            if first_step[i]:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g, alpha=1 - dampening)
            g = g.add(buf, alpha=momentum) if nesterov else buf
        p.add_(g, alpha=-lr)
        if p is not param:
            param.copy_(p)


_SGD_STATE_KEYS = {"momentum_buffers": "momentum_buffer", "master_params": "master_param"}


def _sgd_plan(params: List[Tensor], grads: List[Tensor], momentum_buffers: List[Optional[Tensor]],
              master_params: List[Optional[Tensor]], **cache_args: Any) -> P.Plan:
    return P.Plan(params, grads, {"momentum_buffers": momentum_buffers,
                                  "master_params": master_params},
                  master_slot="master_params", **cache_args)


def _launch_sgd(
    plan: P.Plan, first_step: Optional[List[bool]], *, weight_decay: float, momentum: float,
    lr: float, dampening: float, nesterov: bool, maximize: bool, grad_scale: Optional[Tensor],
    found_inf: Optional[Tensor],
) -> None:
    """One kernel call per (dtype, master-weights) bucket of the plan; ``first_step`` has one
    flag per plan position (None: no buffer is new).  On CPU the caller has already checked
    ``found_inf`` on the host."""
    use_buf = momentum != 0
    for b in plan.buckets:
        n = len(b.numels)
        first = [0] * n if first_step is None else [int(f) for f in P.pick(first_step, b.ids)]
        if not plan.cuda:
            t = b.tables
            B.cpu_ext.sgd(
                t["params"], t["grads"], t["momentum_buffers"] if use_buf else [],
                t["master_params"], first if use_buf else [], b.numels, b.dtype_code, lr,
                momentum, dampening, weight_decay, nesterov, maximize,
                0.0 if grad_scale is None else to_float(grad_scale), B.num_threads())
            continue
        device = plan.device
        lib = B.cuda_lib()
        gs_ptr, _gs_keep = B.scalar_ptr(grad_scale, device)
        fi_ptr, _fi_keep = B.scalar_ptr(found_inf, device)
        a = b.arrays
        with torch.cuda.device(device):
            rc = lib.aiak_fused_sgd_cuda(
                n, b.c_numels, a["params"], a["grads"], a["momentum_buffers"] if use_buf else None,
                a["master_params"], B.int_array(first), b.dtype_code, lr, momentum, dampening,
                weight_decay, int(nesterov), int(maximize), gs_ptr, fi_ptr, B.cuda_stream(device))
        B.check_cuda(rc, "aiak_fused_sgd_cuda")


def fused_sgd(
    params: List[Tensor], grads: List[Tensor], momentum_buffers: List[Optional[Tensor]],
    master_params: Optional[List[Optional[Tensor]]] = None,
    first_step: Optional[List[bool]] = None, *, weight_decay: float, momentum: float, lr: float,
    dampening: float, nesterov: bool, maximize: bool, grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None, use_kernels: bool = True,
) -> None:
    """Functional SGD over parallel lists of tensors on one device.

    ``momentum_buffers`` must be allocated (state dtype) when ``momentum != 0``; entries flagged
    in ``first_step`` are initialised from the gradient, as torch does when the buffer is None.
    ``grad_scale``/``found_inf`` behave as in :func:`fused_adam`.
    """
    if not params:
        return
    n = len(params)
    master_params = master_params if master_params is not None else [None] * n
    first_step = first_step if first_step is not None else [False] * n
    if momentum == 0:
        # Without momentum there are no buffers, so callers may pass no first-step flags
        # either; every path below indexes both lists per tensor.
        momentum_buffers = [None] * n
        first_step = [False] * n
    device = params[0].device

    def tensors_of(i: int) -> List[Tensor]:
        ts = [params[i], grads[i]]
        if momentum != 0:
            ts.append(momentum_buffers[i])
        if master_params[i] is not None:
            ts.append(master_params[i])
        return ts

    def run_fast(idx: List[int]) -> None:
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        plan = _sgd_plan(pick(params), pick(grads), pick(momentum_buffers), pick(master_params))
        _launch_sgd(plan, pick(first_step), weight_decay=weight_decay, momentum=momentum, lr=lr,
                    dampening=dampening, nesterov=nesterov, maximize=maximize,
                    grad_scale=grad_scale, found_inf=found_inf)

    def run_slow(idx: List[int]) -> None:
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        _single_tensor_sgd(
            pick(params), pick(grads), pick(momentum_buffers), pick(master_params),
            pick(first_step), weight_decay=weight_decay, momentum=momentum, lr=lr,
            dampening=dampening, nesterov=nesterov, maximize=maximize,
            inv_scale=None if grad_scale is None else 1.0 / to_float(grad_scale))

    B.dispatch("SGD", device, n, tensors_of, use_kernels, found_inf, run_fast, run_slow)


class FusedSGD(FusedOptimizerBase):
    r"""SGD with momentum/nesterov/weight decay in fused multi-tensor kernels; drop-in for
    :class:`torch.optim.SGD`.

    Same arguments, defaults, ``param_groups`` and ``state_dict`` (``momentum_buffer`` per
    parameter, only when ``momentum != 0``) as torch.  bf16/fp16 params keep fp32 momentum
    buffers (and an fp32 ``master_param`` with ``master_weights=True``).  ``foreach``/``fused``
    are accepted and stored but do not change what runs; ``differentiable=True`` is not
    supported.  All parameters of a param group must be on one device.
    """

    _state_keys = ("momentum_buffer",)

    def __init__(
        self, params: Any, lr: Union[float, Tensor] = 1e-3, momentum: float = 0,
        dampening: float = 0, weight_decay: Union[float, Tensor] = 0, nesterov: bool = False, *,
        maximize: bool = False, foreach: Optional[bool] = None, differentiable: bool = False,
        fused: Optional[bool] = None, master_weights: bool = False,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if differentiable:
            raise ValueError("FusedSGD does not support differentiable=True; use torch.optim.SGD.")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused, master_weights=master_weights)
        super().__init__(params, defaults)

    def _fused_step(self) -> None:
        """Update every parameter that has a gradient (see :meth:`step`), from a cached plan
        when it still describes the group (see _plan.py and FusedAdam._fused_step)."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        cache = P.plans_of(self)
        for index, group in enumerate(self.param_groups):
            momentum = to_float(group["momentum"])
            hyper = dict(weight_decay=to_float(group["weight_decay"]), momentum=momentum,
                         lr=to_float(group["lr"]), dampening=to_float(group["dampening"]),
                         nesterov=group["nesterov"], maximize=group["maximize"],
                         grad_scale=grad_scale, found_inf=found_inf)
            flags = (momentum != 0, bool(group.get("master_weights", False)))
            plan, key = cache.lookup(index, group["params"], self.state, flags)
            if plan is not None:
                if not plan.cuda and found_inf is not None and to_float(found_inf) != 0.0:
                    continue  # the CPU kernels skip on the host, like fused_sgd
                try:
                    _launch_sgd(plan, None, **hyper)
                    continue
                except B.CudaKernelsUnusable as err:  # at the first launch, before any write
                    B.mark_cuda_unusable(plan.device, err)
                    cache.clear()
            self._unplanned_step(group, key, flags, hyper)

    def _unplanned_step(self, group: Dict[str, Any], key: Any, flags: Tuple,
                        hyper: Dict[str, Any]) -> None:
        """Gather the group parameter by parameter, step it, and cache a plan for the next
        steps when every tensor can go through the kernels and no buffer is new."""
        momentum, found_inf = hyper["momentum"], hyper["found_inf"]
        params: List[Tensor] = []
        grads: List[Tensor] = []
        bufs: List[Optional[Tensor]] = []
        masters: List[Optional[Tensor]] = []
        first: List[bool] = []
        new_bufs: List[Tuple[Tensor, Tensor]] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            grads.append(self._check_grad(p))
            params.append(p)
            # Like torch, create state entries only when there is something to keep.
            wants_master = group.get("master_weights", False) and p.dtype in B.LOW_PRECISION
            masters.append(self._master_for(group, self.state[p], p) if wants_master else None)
            if momentum != 0:
                buf = self.state[p].get("momentum_buffer")
                is_first = buf is None
                if is_first:  # torch: buf = grad.clone() on the first step
                    buf = torch.empty_like(p, dtype=B.state_dtype(p.dtype),
                                           memory_format=torch.preserve_format)
                    new_bufs.append((p, buf))
                bufs.append(buf)
                first.append(is_first)
            else:
                bufs.append(None)
        if not params:
            return
        # A buffer enters the state only once a step has initialised it, as in torch.  With
        # new buffers and a found_inf (GradScaler) we need to know whether this step runs;
        # that costs one host sync, on the first step only.
        skipped = bool(new_bufs) and found_inf is not None and to_float(found_inf) != 0.0
        fused_sgd(params, grads, bufs, masters, first if momentum != 0 else None, **hyper)
        if not skipped:
            for p, buf in new_bufs:
                self.state[p]["momentum_buffer"] = buf
        if new_bufs and skipped:
            return
        per_position = [[t for t in ts if t is not None]
                        for ts in zip(params, grads, bufs, masters)]
        if P.plannable(params[0].device, per_position):
            keys = dict(_SGD_STATE_KEYS)
            if momentum == 0:
                del keys["momentum_buffers"]
            P.plans_of(self).store(_sgd_plan(
                params, grads, bufs, masters, state_keys=keys, key=key, flags=flags,
                state=self.state, group_params=group["params"]))
