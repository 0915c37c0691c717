"""FusedAdam / FusedAdamW: drop-in replacements for torch.optim.Adam / AdamW.

Layout follows torch/optim/adam.py: the optimizer classes gather tensors per param group and
call the functional :func:`fused_adam`, which picks

* ``_multi_tensor_fused_adam``: one pass over memory for all tensors of a dtype (CPU SIMD
  kernels in csrc/fused_optim, CUDA multi-tensor-apply kernels in csrc/cuda), or
* ``_single_tensor_adam``: the reference, written with torch ops exactly like torch's for-loop
  path but with fp32 maths for bf16/fp16 params.  It is used for tensors the kernels cannot walk
  as flat arrays (non-dense layouts) and when a compiled backend is missing.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _backend as B
from ._base import FusedOptimizerBase, to_float

__all__ = ["FusedAdam", "FusedAdamW", "fused_adam"]


def _single_tensor_adam(
    params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Optional[Tensor]], state_steps: List[Tensor],
    master_params: List[Optional[Tensor]], *, amsgrad: bool, beta1: float, beta2: float, lr: float,
    weight_decay: float, eps: float, maximize: bool, decoupled_weight_decay: bool,
    inv_scale: Optional[float],
) -> None:
    """Reference Adam/AdamW, one tensor at a time (mirrors torch.optim's for-loop path)."""
    for i, param in enumerate(params):
        grad, exp_avg, exp_avg_sq, master = grads[i], exp_avgs[i], exp_avg_sqs[i], master_params[i]
        opmath = B.state_dtype(param.dtype)
        if inv_scale is not None:  # unscale and store, as torch's fused kernels do
            grad.copy_(grad.to(opmath) * inv_scale)
        g = grad.to(opmath)
        if maximize:
            g = -g
        # p aliases the parameter for fp32/fp64; for bf16/fp16 it is an fp32 copy (or master)
        p = master if master is not None else param.to(opmath)
        state_steps[i] += 1
        step = float(state_steps[i].item())
        if weight_decay != 0:
            if decoupled_weight_decay:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
            denom = (max_exp_avg_sqs[i].sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-step_size)
        if p is not param:
            param.copy_(p)


def _multi_tensor_fused_adam(
    idx: Sequence[int], params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor], max_exp_avg_sqs: List[Optional[Tensor]], state_steps: List[Tensor],
    master_params: List[Optional[Tensor]], *, amsgrad: bool, beta1: float, beta2: float, lr: float,
    weight_decay: float, eps: float, maximize: bool, decoupled_weight_decay: bool,
    grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
) -> None:
    """One kernel call per (dtype, master-weights) bucket of the tensors at positions ``idx``."""
    device = params[idx[0]].device
    for (dtype, has_master), ids in B.kernel_buckets(params, master_params, idx).items():
        ps = [params[i] for i in ids]
        numels = [p.numel() for p in ps]
        if device.type == "cpu":
            gs = 0.0 if grad_scale is None else to_float(grad_scale)
            B.cpu_ext.adam(
                [p.data_ptr() for p in ps], [grads[i].data_ptr() for i in ids],
                [exp_avgs[i].data_ptr() for i in ids], [exp_avg_sqs[i].data_ptr() for i in ids],
                [max_exp_avg_sqs[i].data_ptr() for i in ids] if amsgrad else [],
                [master_params[i].data_ptr() for i in ids] if has_master else [],
                [state_steps[i].data_ptr() for i in ids], numels, B.DTYPE_CODES[dtype],
                lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, amsgrad, maximize,
                gs, B.num_threads())
        else:
            lib = B.cuda_lib()
            gs_ptr, _gs_keep = B.scalar_ptr(grad_scale, device)
            fi_ptr, _fi_keep = B.scalar_ptr(found_inf, device)
            with torch.cuda.device(device):
                rc = lib.aiak_fused_adam_cuda(
                    len(ids), B.int64_array(numels), B.ptr_array(ps),
                    B.ptr_array([grads[i] for i in ids]), B.ptr_array([exp_avgs[i] for i in ids]),
                    B.ptr_array([exp_avg_sqs[i] for i in ids]),
                    B.ptr_array([max_exp_avg_sqs[i] if amsgrad else None for i in ids]),
                    B.ptr_array([master_params[i] for i in ids]),
                    B.ptr_array([state_steps[i] for i in ids]), B.DTYPE_CODES[dtype],
                    lr, beta1, beta2, eps, weight_decay, int(decoupled_weight_decay), int(amsgrad),
                    int(maximize), gs_ptr, fi_ptr, B.cuda_stream(device))
            B.check_cuda(rc, "aiak_fused_adam_cuda")


def fused_adam(
    params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Optional[Tensor]], state_steps: List[Tensor],
    master_params: Optional[List[Optional[Tensor]]] = None, *, amsgrad: bool,
    beta1: float, beta2: float, lr: float, weight_decay: float, eps: float, maximize: bool,
    decoupled_weight_decay: bool = False, grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None, use_kernels: bool = True,
) -> None:
    """Functional Adam/AdamW over parallel lists of tensors on one device.

    ``state_steps`` are per-parameter float32 scalar tensors (on CPU for CPU params, on the
    device for CUDA params); each is advanced by one unless ``found_inf`` is non-zero, in which
    case nothing at all changes.  ``grad_scale`` (GradScaler's scale) unscales the gradients,
    which are stored back unscaled.  ``master_params`` holds fp32 copies for bf16/fp16 params
    (or None entries).  ``use_kernels=False`` forces the reference path.
    """
    if not params:
        return
    n = len(params)
    master_params = master_params if master_params is not None else [None] * n
    if not amsgrad:
        max_exp_avg_sqs = [None] * n
    device = params[0].device

    def tensors_of(i: int) -> List[Tensor]:
        ts = [params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]]
        if amsgrad:
            ts.append(max_exp_avg_sqs[i])
        if master_params[i] is not None:
            ts.append(master_params[i])
        return ts

    def run_fast(idx: List[int]) -> None:
        _multi_tensor_fused_adam(
            idx, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
            amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
            maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
            grad_scale=grad_scale, found_inf=found_inf)

    def run_slow(idx: List[int]) -> None:
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        _single_tensor_adam(
            pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(max_exp_avg_sqs),
            pick(state_steps), pick(master_params), amsgrad=amsgrad, beta1=beta1, beta2=beta2,
            lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            inv_scale=None if grad_scale is None else 1.0 / to_float(grad_scale))

    B.dispatch("Adam", device, n, tensors_of, use_kernels, found_inf, run_fast, run_slow)


class FusedAdam(FusedOptimizerBase):
    r"""Adam (or AdamW with ``decoupled_weight_decay=True``) with fused multi-tensor kernels.

    Same arguments, defaults, ``param_groups`` and ``state_dict`` as :class:`torch.optim.Adam`;
    checkpoints load into either class.  Each step reads param, grad and the states once and
    writes them once, for all parameters of a param group.  ``weight_decay`` is the L2 penalty
    (added to the gradient) unless ``decoupled_weight_decay``.

    Differences from torch.optim.Adam:

    * bf16/fp16 params keep fp32 optimizer states and do the maths in fp32;
      ``master_weights=True`` also keeps an fp32 copy of each such param
      (``state['master_param']``) so small updates are not lost to rounding.
    * ``foreach``, ``fused`` and ``capturable`` are accepted for compatibility and stored in
      the param groups; they do not change what this class runs.  ``differentiable=True`` is
      not supported.
    * Every parameter of a param group must be on one device (CPU or CUDA).
    """

    _state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(
        self, params: Any, lr: Union[float, Tensor] = 1e-3,
        betas: Tuple[Union[float, Tensor], Union[float, Tensor]] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
        maximize: bool = False, capturable: bool = False, differentiable: bool = False,
        fused: Optional[bool] = None, decoupled_weight_decay: bool = False,
        master_weights: bool = False,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if differentiable:
            raise ValueError(f"{type(self).__name__} does not support differentiable=True; "
                             "use torch.optim.Adam for that.")
        betas = (to_float(betas[0]), to_float(betas[1]))
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay,
                        master_weights=master_weights)
        super().__init__(params, defaults)

    def _init_group(self, group: Dict[str, Any], lists: Dict[str, list]) -> None:
        # Runs for every parameter on every step: plain loops and local names keep the Python
        # overhead small next to the kernel (it matters for models with many small tensors).
        amsgrad = group["amsgrad"]
        masters_wanted = group.get("master_weights", False)
        state_of = self.state
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters = (
            lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
            lists["max_exp_avg_sqs"], lists["state_steps"], lists["master_params"])
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = self._check_grad(p)
            state = state_of[p]
            if len(state) == 0:
                state["step"] = self._new_step(p)
                state["exp_avg"] = self._zeros_state(p)
                state["exp_avg_sq"] = self._zeros_state(p)
                if amsgrad:
                    state["max_exp_avg_sq"] = self._zeros_state(p)
            if amsgrad:
                if "max_exp_avg_sq" not in state:  # amsgrad switched on later
                    state["max_exp_avg_sq"] = self._zeros_state(p)
                max_sqs.append(state["max_exp_avg_sq"])
            else:
                max_sqs.append(None)
            params.append(p)
            grads.append(grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
            masters.append(self._master_for(group, state, p) if masters_wanted else None)

    def _fused_step(self) -> None:
        """Update every parameter that has a gradient (see :meth:`step`)."""
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            lists: Dict[str, list] = {k: [] for k in (
                "params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps",
                "master_params")}
            self._init_group(group, lists)
            beta1, beta2 = group["betas"]
            fused_adam(
                lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
                lists["max_exp_avg_sqs"], lists["state_steps"], lists["master_params"],
                amsgrad=group["amsgrad"], beta1=to_float(beta1), beta2=to_float(beta2),
                lr=to_float(group["lr"]), weight_decay=to_float(group["weight_decay"]),
                eps=float(group["eps"]), maximize=group["maximize"],
                decoupled_weight_decay=group["decoupled_weight_decay"],
                grad_scale=grad_scale, found_inf=found_inf)


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay, default 1e-2) with fused kernels; drop-in for
    :class:`torch.optim.AdamW`.  See :class:`FusedAdam`."""

    def __init__(
        self, params: Any, lr: Union[float, Tensor] = 1e-3,
        betas: Tuple[Union[float, Tensor], Union[float, Tensor]] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
        foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
        fused: Optional[bool] = None, master_weights: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, master_weights=master_weights)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # as torch.optim.AdamW: always decoupled
            group["decoupled_weight_decay"] = True
