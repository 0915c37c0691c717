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

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _backend as B
from ._base import FusedOptimizerBase, to_float

__all__ = ["FusedLAMB", "fused_lamb", "global_grad_norm"]


def _single_tensor_lamb(
    params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor], master_params: List[Optional[Tensor]], *, lr: float, beta1: float,
    beta2: float, eps: float, weight_decay: float, bias_correction: bool, grad_averaging: bool,
    adam_w_mode: bool, use_nvlamb: bool, clip: float, inv_scale: Optional[float],
) -> None:
    """Reference LAMB with torch ops, one tensor at a time."""
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i, param in enumerate(params):
        grad, m, v, master = grads[i], exp_avgs[i], exp_avg_sqs[i], master_params[i]
        opmath = B.state_dtype(param.dtype)
        g = grad.to(opmath)
        if inv_scale is not None:
            grad.copy_(g * inv_scale)
            g = g * (inv_scale / clip)
        elif clip != 1.0:
            g = g * (1.0 / clip)
        p = master if master is not None else param.to(opmath)
        state_steps[i] += 1
        step = float(state_steps[i].item())
        bc1 = 1 - beta1 ** step if bias_correction else 1.0
        bc2 = 1 - beta2 ** step if bias_correction else 1.0
        if not adam_w_mode and weight_decay != 0:
            g = g + weight_decay * p
        m.mul_(beta1).add_(g, alpha=beta3)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = (m / bc1) / ((v / bc2).sqrt() + eps)
        if adam_w_mode and weight_decay != 0:
            u.add_(p, alpha=weight_decay)
        ratio = lr
        if weight_decay != 0 or use_nvlamb:
            p_norm = float(p.double().norm())
            u_norm = float(u.double().norm())
            if p_norm > 0 and u_norm > 0:
                ratio = lr * (p_norm / u_norm)
        p.add_(u, alpha=-ratio)
        if p is not param:
            param.copy_(p)


def global_grad_norm(grads: Sequence[Tensor], grad_scale: Optional[Tensor] = None) -> Optional[Tensor]:
    """L2 norm of all gradients (unscaled by ``grad_scale``), as a float64 scalar tensor on the
    first gradient's device.  CPU and CUDA gradients use the fused kernels (deterministic
    order); other cases fall back to torch ops."""
    if not grads:
        return None
    by_device: Dict[torch.device, List[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    target = grads[0].device
    total = torch.zeros((), dtype=torch.float64, device=target)
    for device, gs in by_device.items():
        part = torch.zeros((), dtype=torch.float64, device=device)
        by_dtype: Dict[torch.dtype, List[Tensor]] = {}
        for g in gs:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, ts in by_dtype.items():
            friendly = [t for t in ts if t.is_contiguous()]
            other = [t for t in ts if not t.is_contiguous()]
            if device.type == "cpu" and B.cpu_ext is not None and friendly:
                sums = B.cpu_ext.sum_squares([t.data_ptr() for t in friendly],
                                             [t.numel() for t in friendly], B.DTYPE_CODES[dtype],
                                             B.num_threads())
                part += math.fsum(sums)
            elif device.type == "cuda" and B.cuda_lib() is not None and friendly:
                lib = B.cuda_lib()
                numels = B.int64_array([t.numel() for t in friendly])
                out = torch.zeros((), dtype=torch.float32, device=device)
                ws = torch.empty(int(lib.aiak_fused_lamb_cuda_workspace_bytes(len(friendly), numels)),
                                 dtype=torch.uint8, device=device)
                with torch.cuda.device(device):
                    rc = lib.aiak_fused_sum_squares_cuda(
                        len(friendly), numels, B.ptr_array(friendly), B.DTYPE_CODES[dtype],
                        out.data_ptr(), ws.data_ptr(), B.cuda_stream(device))
                B.check_cuda(rc, "aiak_fused_sum_squares_cuda")
                part += out.double()
            else:
                other = ts
            for t in other:
                part += t.double().pow(2).sum()
        total += part.to(target)
    norm = total.sqrt()
    if grad_scale is not None:
        norm = norm / grad_scale.to(device=target, dtype=torch.float64)
    return norm


def _multi_tensor_fused_lamb(
    idx: Sequence[int], params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor], state_steps: List[Tensor], master_params: List[Optional[Tensor]],
    *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    bias_correction: bool, grad_averaging: bool, adam_w_mode: bool, use_nvlamb: bool,
    max_grad_norm: float, grad_norm: Optional[Tensor], clip: float,
    grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
) -> None:
    device = params[idx[0]].device
    for (dtype, has_master), ids in B.kernel_buckets(params, master_params, idx).items():
        ps = [params[i] for i in ids]
        numels = [p.numel() for p in ps]
        if device.type == "cpu":
            gs = 0.0 if grad_scale is None else to_float(grad_scale)
            B.cpu_ext.lamb(
                [p.data_ptr() for p in ps], [grads[i].data_ptr() for i in ids],
                [exp_avgs[i].data_ptr() for i in ids], [exp_avg_sqs[i].data_ptr() for i in ids],
                [master_params[i].data_ptr() for i in ids] if has_master else [],
                [state_steps[i].data_ptr() for i in ids], numels, B.DTYPE_CODES[dtype],
                lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
                adam_w_mode, use_nvlamb, clip, gs, B.num_threads())
        else:
            lib = B.cuda_lib()
            n_arr = B.int64_array(numels)
            ws = torch.empty(int(lib.aiak_fused_lamb_cuda_workspace_bytes(len(ids), n_arr)),
                             dtype=torch.uint8, device=device)
            gs_ptr, _gs_keep = B.scalar_ptr(grad_scale, device)
            fi_ptr, _fi_keep = B.scalar_ptr(found_inf, device)
            gn_ptr, _gn_keep = B.scalar_ptr(grad_norm, device)
            with torch.cuda.device(device):
                rc = lib.aiak_fused_lamb_cuda(
                    len(ids), n_arr, B.ptr_array(ps), B.ptr_array([grads[i] for i in ids]),
                    B.ptr_array([exp_avgs[i] for i in ids]),
                    B.ptr_array([exp_avg_sqs[i] for i in ids]),
                    B.ptr_array([master_params[i] for i in ids]),
                    B.ptr_array([state_steps[i] for i in ids]), B.DTYPE_CODES[dtype],
                    lr, beta1, beta2, eps, weight_decay, int(bias_correction),
                    int(grad_averaging), int(adam_w_mode), int(use_nvlamb),
                    max_grad_norm if grad_norm is not None else 0.0, gn_ptr,
                    gs_ptr, fi_ptr, ws.data_ptr(), B.cuda_stream(device))
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

    def host_clip() -> float:
        """Clip divisor for the CPU kernels and the reference path (CUDA reads it on device)."""
        if not clipping:
            return 1.0
        norm = to_float(grad_norm)
        return norm / max_grad_norm if norm > max_grad_norm else 1.0

    def tensors_of(i: int) -> List[Tensor]:
        ts = [params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]]
        if master_params[i] is not None:
            ts.append(master_params[i])
        return ts

    def run_fast(idx: List[int]) -> None:
        _multi_tensor_fused_lamb(
            idx, params, grads, exp_avgs, exp_avg_sqs, state_steps, master_params, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, grad_averaging=grad_averaging,
            adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb,
            max_grad_norm=max_grad_norm or 0.0, grad_norm=grad_norm if clipping else None,
            clip=host_clip() if device.type == "cpu" else 1.0, grad_scale=grad_scale,
            found_inf=found_inf)

    def run_slow(idx: List[int]) -> None:
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        _single_tensor_lamb(
            pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(state_steps),
            pick(master_params), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, bias_correction=bias_correction,
            grad_averaging=grad_averaging, adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb,
            clip=host_clip(), inv_scale=None if grad_scale is None else 1.0 / to_float(grad_scale))

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
        """Update every parameter that has a gradient (see :meth:`step`)."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        per_group = []
        all_grads: List[Tensor] = []
        for group in self.param_groups:
            lists: Dict[str, list] = {k: [] for k in ("params", "grads", "exp_avgs", "exp_avg_sqs",
                                                      "state_steps", "master_params")}
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
                lists["state_steps"].append(state["step"])
                lists["master_params"].append(self._master_for(group, state, p))
            per_group.append((group, lists))
            all_grads.extend(lists["grads"])
        # Global clipping needs every gradient before any update (Apex: over all groups).
        max_grad_norm = self.defaults.get("max_grad_norm")
        clipping = max_grad_norm is not None and max_grad_norm > 0
        grad_norm = global_grad_norm(all_grads, grad_scale) if clipping and all_grads else None
        for group, lists in per_group:
            beta1, beta2 = group["betas"]
            fused_lamb(
                lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
                lists["state_steps"], lists["master_params"], lr=to_float(group["lr"]),
                beta1=to_float(beta1), beta2=to_float(beta2), eps=float(group["eps"]),
                weight_decay=to_float(group["weight_decay"]),
                bias_correction=bool(group["bias_correction"]),
                grad_averaging=bool(group["grad_averaging"]),
                adam_w_mode=bool(group["adam_w_mode"]), use_nvlamb=bool(group["use_nvlamb"]),
                max_grad_norm=max_grad_norm if clipping else None, grad_norm=grad_norm,
                grad_scale=grad_scale, found_inf=found_inf)
