"""FusedLAMB: LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in
76 minutes", 2019) with the options and defaults of Apex's ``FusedLAMB``.

Per step, for every parameter tensor ``p`` with gradient ``g`` (all maths in fp32, or fp64 for
fp64 params):

1. global gradient clipping (over all param groups): ``g /= max(||G|| / max_grad_norm, 1)``
   where ``||G||`` is the L2 norm of all (unscaled) gradients; off when ``max_grad_norm`` is
   None or <= 0.
2. L2 mode (``adam_w_mode=False``): ``g += weight_decay * p``.
3. ``m = beta1*m + beta3*g`` with ``beta3 = 1 - beta1`` if ``grad_averaging`` else ``1``;
   ``v = beta2*v + (1 - beta2)*g*g``.
4. ``u = (m/bc1) / (sqrt(v/bc2) + eps)`` with ``bc = 1 - beta^step`` if ``bias_correction``
   else ``1``; decoupled mode (``adam_w_mode=True``): ``u += weight_decay * p``.
5. trust ratio ``r = ||p|| / ||u||`` per tensor when ``weight_decay != 0`` or ``use_nvlamb``,
   and both norms are non-zero; otherwise ``r = 1``.  ``p -= lr * r * u``.

Differences from Apex: the step count is per parameter (torch's layout, so any subset of
params can be stepped), the gradient is not overwritten with the update, bf16 and fp64 are
supported, and the per-tensor norms are reduced in a fixed order (bit-identical on every rank).
On CPU the sums of squares (the norms above) accumulate in float64: float accumulators left an
ISA-dependent error that step 2's near-cancellations (g / clip + wd * p) amplified.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import _backend as B
from . import _plan as P
from ._base import FusedOptimizerBase, to_float
from ._grad_norm import NormParts, global_grad_norm

__all__ = ["FusedLAMB", "fused_lamb", "global_grad_norm"]


def _lamb_update(param: Tensor, g: Tensor, m: Tensor, v: Tensor, state_step: Tensor,
                 master: Optional[Tensor], *, beta1: float, beta2: float, eps: float,
                 weight_decay: float, bias_correction: bool, grad_averaging: bool,
                 adam_w_mode: bool) -> Tuple[Tensor, Tensor]:
    """Steps 2-4 of the module docstring for one tensor, on the (already clipped) gradient
    ``g`` in opmath: advances the step count and the moments in place, returns the weights
    the update applies to (the master copy, or ``param`` in opmath) and the update ``u``."""
    beta3 = 1 - beta1 if grad_averaging else 1.0
    p = master if master is not None else param.to(B.state_dtype(param.dtype))
    state_step += 1
    step = float(state_step.item())
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    if not adam_w_mode and weight_decay != 0:
        g = g + weight_decay * p
    m.mul_(beta1).add_(g, alpha=beta3)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    u = (m / bc1) / ((v / bc2).sqrt() + eps)
    if adam_w_mode and weight_decay != 0:
        u.add_(p, alpha=weight_decay)
    return p, u


def _single_tensor_lamb(
    params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor], master_params: List[Optional[Tensor]], *, lr: float, beta1: float,
    beta2: float, eps: float, weight_decay: float, bias_correction: bool, grad_averaging: bool,
    adam_w_mode: bool, use_nvlamb: bool, clip: float, inv_scale: Optional[float],
) -> None:
    """Reference LAMB with torch ops, one tensor at a time."""
    for i, param in enumerate(params):
        grad = grads[i]
        g = grad.to(B.state_dtype(param.dtype))
        if inv_scale is not None:
            grad.copy_(g * inv_scale)
            g = g * (inv_scale / clip)
        else:
            g = clip_gradient(g, clip)
        p, u = _lamb_update(param, g, exp_avgs[i], exp_avg_sqs[i], state_steps[i],
                            master_params[i], beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, bias_correction=bias_correction,
                            grad_averaging=grad_averaging, adam_w_mode=adam_w_mode)
        norms = None
        if weight_decay != 0 or use_nvlamb:
            norms = (float(p.double().norm()), float(u.double().norm()))
        apply_trust_ratio(param, p, u, lr, norms)


def clip_divisor(norm: float, max_grad_norm: float) -> float:
    """Step 1's divisor for a global gradient norm of ``norm``: ``norm / max_grad_norm``
    when the norm is larger, else 1 (no clipping)."""
    return norm / max_grad_norm if norm > max_grad_norm else 1.0


def clip_gradient(g: Tensor, clip: float) -> Tensor:
    """``g`` (in opmath) divided by step 1's divisor ``clip``; ``g`` itself when it is 1."""
    return g * (1.0 / clip) if clip != 1.0 else g


def apply_trust_ratio(param: Tensor, p: Tensor, u: Tensor, lr: float,
                      norms: Optional[Tuple[float, float]]) -> None:
    """Step 5 for one tensor: ``p -= lr * r * u``, with the trust ratio ``r = ||p|| / ||u||``
    of the whole tensor's ``norms`` (None: no trust ratio; 1 where a norm is zero), then
    ``param`` updated from ``p`` when ``p`` is a master or opmath copy."""
    ratio = lr
    if norms is not None and norms[0] > 0 and norms[1] > 0:
        ratio = lr * (norms[0] / norms[1])
    p.add_(u, alpha=-ratio)
    if p is not param:
        param.copy_(p)


# fused_lamb's positional lists; all but the first two are also the tables of a plan.
_LIST_KEYS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "state_steps", "master_params")
# Plan table -> the optimizer state key it comes from.
_LAMB_STATE_KEYS = {"exp_avgs": "exp_avg", "exp_avg_sqs": "exp_avg_sq",
                    "master_params": "master_param", "state_steps": "step"}


def _lamb_plan(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
               exp_avg_sqs: List[Tensor], state_steps: List[Tensor],
               master_params: List[Optional[Tensor]], **cache_args: Any) -> P.Plan:
    return P.Plan(params, grads, dict(zip(_LIST_KEYS[2:], (
        exp_avgs, exp_avg_sqs, state_steps, master_params))),
        master_slot="master_params", **cache_args)


def _clip_divisor(grad_norm: Optional[Tensor], max_grad_norm: Optional[float]) -> float:
    """What the CPU kernels and the reference path divide gradients by (a host sync); the CUDA
    kernels read the norm on the device instead."""
    if grad_norm is None or max_grad_norm is None or max_grad_norm <= 0:
        return 1.0
    return clip_divisor(to_float(grad_norm), max_grad_norm)


def _launch_lamb(
    plan: P.Plan, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    bias_correction: bool, grad_averaging: bool, adam_w_mode: bool, use_nvlamb: bool,
    max_grad_norm: float, grad_norm: Optional[Tensor], clip: float,
    grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
) -> None:
    """One kernel call per (dtype, master-weights) bucket of the plan.  ``clip`` is the host
    divisor for the CPU kernels; CUDA kernels take ``grad_norm`` (clipping off when None) and
    check ``found_inf`` on the device.  On CPU the caller has checked ``found_inf``."""
    if not plan.cuda:
        gs = 0.0 if grad_scale is None else to_float(grad_scale)
        threads = B.num_threads()
        for b in plan.buckets:
            t = b.tables
            B.cpu_ext.lamb(
                t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sqs"], t["master_params"],
                t["state_steps"], b.numels, b.dtype_code, lr, beta1, beta2, eps, weight_decay,
                bias_correction, grad_averaging, adam_w_mode, use_nvlamb, clip, gs, threads)
        return
    device = plan.device
    lib = B.cuda_lib()
    gs_ptr, _gs_keep = B.scalar_ptr(grad_scale, device)
    fi_ptr, _fi_keep = B.scalar_ptr(found_inf, device)
    gn_ptr, _gn_keep = B.scalar_ptr(grad_norm, device)
    stream = B.cuda_stream(device)
    with torch.cuda.device(device):
        for b in plan.buckets:
            a = b.arrays
            # Allocated per launch on the current stream, so the caching allocator orders its
            # reuse; the size is one C call over the numels array.
            ws = torch.empty(int(lib.aiak_fused_lamb_cuda_workspace_bytes(len(b.numels), b.c_numels)),
                             dtype=torch.uint8, device=device)
            rc = lib.aiak_fused_lamb_cuda(
                len(b.numels), b.c_numels, a["params"], a["grads"], a["exp_avgs"],
                a["exp_avg_sqs"], a["master_params"], a["state_steps"], b.dtype_code,
                lr, beta1, beta2, eps, weight_decay, int(bias_correction),
                int(grad_averaging), int(adam_w_mode), int(use_nvlamb),
                max_grad_norm if grad_norm is not None else 0.0, gn_ptr,
                gs_ptr, fi_ptr, ws.data_ptr(), stream)
            B.check_cuda(rc, "aiak_fused_lamb_cuda")


def fused_lamb(
    params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor], master_params: Optional[List[Optional[Tensor]]] = None, *,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    bias_correction: bool = True, grad_averaging: bool = True, adam_w_mode: bool = True,
    use_nvlamb: bool = False, max_grad_norm: Optional[float] = None,
    grad_norm: Optional[Tensor] = None, grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None, use_kernels: bool = True,
) -> None:
    """Functional LAMB over parallel lists of tensors on one device (see the module docstring).

    ``grad_norm`` is the global L2 norm of the unscaled gradients (from
    :func:`global_grad_norm`), used for clipping when ``max_grad_norm`` > 0.
    """
    if not params:
        return
    n = len(params)
    master_params = master_params if master_params is not None else [None] * n
    device = params[0].device
    clipping = grad_norm is not None and max_grad_norm is not None and max_grad_norm > 0

    def tensors_of(i: int) -> List[Tensor]:
        ts = [params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]]
        if master_params[i] is not None:
            ts.append(master_params[i])
        return ts

    def run_fast(idx: List[int]) -> None:
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        plan = _lamb_plan(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                          pick(state_steps), pick(master_params))
        _launch_lamb(
            plan, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, grad_averaging=grad_averaging,
            adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb,
            max_grad_norm=max_grad_norm or 0.0, grad_norm=grad_norm if clipping else None,
            clip=1.0 if plan.cuda else _clip_divisor(grad_norm if clipping else None, max_grad_norm),
            grad_scale=grad_scale, found_inf=found_inf)

    def run_slow(idx: List[int]) -> None:
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        _single_tensor_lamb(
            pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(state_steps),
            pick(master_params), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, bias_correction=bias_correction,
            grad_averaging=grad_averaging, adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb,
            clip=_clip_divisor(grad_norm if clipping else None, max_grad_norm),
            inv_scale=None if grad_scale is None else 1.0 / to_float(grad_scale))

    B.dispatch("LAMB", device, n, tensors_of, use_kernels, found_inf, run_fast, run_slow)


class FusedLAMB(FusedOptimizerBase):
    r"""LAMB with fused multi-tensor kernels (CPU and CUDA); options and defaults as Apex's
    ``FusedLAMB``.  See the module docstring for the exact update.

    Args:
        params: iterable of parameters or param-group dicts.
        lr: learning rate (default 1e-3).
        bias_correction: divide m and v by ``1 - beta^step`` (default True).
        betas: coefficients for the running averages of the gradient and its square
            (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-6).
        weight_decay: weight decay (default 0.01); decoupled (added to the update) when
            ``adam_w_mode``, else an L2 term added to the gradient.
        amsgrad: not supported (as in Apex); must be False.
        adam_w_mode: decoupled weight decay (default True).
        grad_averaging: use ``1 - beta1`` for the gradient in m (default True); else 1.
        set_grad_none: ``zero_grad()`` sets grads to None by default (default True).
        max_grad_norm: clip the global gradient norm (over all param groups) to this value
            before the update (default 1.0); None or <= 0 disables clipping.
        use_nvlamb: apply the trust ratio also to params with ``weight_decay == 0`` (NVLAMB;
            default False).
        master_weights: keep an fp32 copy of bf16/fp16 params (default False).

    The state per parameter is ``step`` (float32 scalar), ``exp_avg`` and ``exp_avg_sq``.
    """

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
        betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
        amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
        set_grad_none: bool = True, max_grad_norm: Optional[float] = 1.0,
        use_nvlamb: bool = False, *, master_weights: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        if not 0.0 <= to_float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, adam_w_mode=adam_w_mode,
                        use_nvlamb=use_nvlamb, set_grad_none=set_grad_none,
                        master_weights=master_weights)
        super().__init__(params, defaults)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Reset gradients; to None unless ``set_grad_none=False`` was given (as Apex)."""
        if set_to_none is None:
            set_to_none = bool(self.defaults.get("set_grad_none", True))
        super().zero_grad(set_to_none=set_to_none)

    def _fused_step(self) -> None:
        """Update every parameter that has a gradient (see :meth:`step`).

        As FusedAdam: each group's tables come from a cached plan (see _plan.py) while it still
        describes the group.  LAMB first needs the norm of every gradient of every group
        (global clipping, as Apex), so all groups are resolved before any update; the planned
        groups hand the norm their gradient tables as they are."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        cache = P.plans_of(self)
        resolved = []  # (group, plan or None, gathered lists or None)
        parts = NormParts()
        for index, group in enumerate(self.param_groups):
            flags = (bool(group.get("master_weights", False)),)
            plan, key = cache.lookup(index, group["params"], self.state, flags)
            lists = None
            if plan is None:
                lists = self._gather(group)
                plan = self._new_plan(lists, key, flags, group)
                if plan is not None:
                    cache.store(plan)
                    lists = None
            if plan is not None:
                parts.add_plan(plan)
            elif lists["params"]:
                parts.add_tensors(lists["grads"])
            resolved.append((group, plan, lists))
        max_grad_norm = self.defaults.get("max_grad_norm")
        clipping = max_grad_norm is not None and max_grad_norm > 0
        grad_norm = parts.norm(grad_scale) if clipping and parts else None
        clip: Optional[float] = None  # the host divisor, synced once for all CPU groups
        for group, plan, lists in resolved:
            beta1, beta2 = group["betas"]
            hyper = dict(lr=to_float(group["lr"]), beta1=to_float(beta1), beta2=to_float(beta2),
                         eps=float(group["eps"]), weight_decay=to_float(group["weight_decay"]),
                         bias_correction=bool(group["bias_correction"]),
                         grad_averaging=bool(group["grad_averaging"]),
                         adam_w_mode=bool(group["adam_w_mode"]),
                         use_nvlamb=bool(group["use_nvlamb"]), grad_norm=grad_norm,
                         grad_scale=grad_scale, found_inf=found_inf)
            if plan is not None:
                if not plan.cuda:
                    if found_inf is not None and to_float(found_inf) != 0.0:
                        continue  # the CPU kernels skip on the host, like fused_lamb
                    if clip is None:
                        clip = _clip_divisor(grad_norm, max_grad_norm)
                try:
                    _launch_lamb(plan, max_grad_norm=max_grad_norm if clipping else 0.0,
                                 clip=1.0 if plan.cuda else clip, **hyper)
                    continue
                except B.CudaKernelsUnusable as err:  # at the first launch, before any write
                    B.mark_cuda_unusable(plan.device, err)
                    cache.clear()
                    lists = self._gather(group)
            if lists["params"]:
                fused_lamb(*(lists[k] for k in _LIST_KEYS),
                           max_grad_norm=max_grad_norm if clipping else None, **hyper)

    def _gather(self, group: Dict[str, Any]) -> Dict[str, list]:
        """The group's tensors as fused_lamb's lists, creating missing state."""
        lists: Dict[str, list] = {k: [] for k in _LIST_KEYS}
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = self._check_grad(p)
            state = self.state[p]
            if len(state) == 0:
                state["step"] = self._new_step(p)
                state["exp_avg"] = self._zeros_state(p)
                state["exp_avg_sq"] = self._zeros_state(p)
            lists["params"].append(p)
            lists["grads"].append(grad)
            lists["exp_avgs"].append(state["exp_avg"])
            lists["exp_avg_sqs"].append(state["exp_avg_sq"])
            lists["master_params"].append(self._master_for(group, state, p))
            lists["state_steps"].append(state["step"])
        return lists

    def _new_plan(self, lists: Dict[str, list], key: Any, flags: Tuple,
                  group: Dict[str, Any]) -> Optional[P.Plan]:
        """A plan for the gathered group, or None when some tensor needs the reference path
        (or the group has no gradient)."""
        params = lists["params"]
        per_position = [[t for t in ts if t is not None] for ts in zip(
            params, lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
            lists["master_params"])]
        if not params or not P.plannable(params[0].device, per_position):
            return None
        return _lamb_plan(*(lists[k] for k in _LIST_KEYS), state_keys=dict(_LAMB_STATE_KEYS),
                          key=key, flags=flags, state=self.state, group_params=group["params"])
