"""FusedAdam / FusedAdamW: drop-in replacements for torch.optim.Adam / AdamW.

Layout follows torch/optim/adam.py: the optimizer classes gather tensors per param group and
call the functional :func:`fused_adam`, which picks

* ``_launch_adam``: one pass over memory for all tensors of a dtype (CPU SIMD kernels in
  csrc/fused_optim, CUDA multi-tensor-apply kernels in csrc/cuda), with the tables of a
  ``_plan.Plan`` (the optimizer classes cache it across steps), or
* ``_single_tensor_adam``: the reference, written with torch ops exactly like torch's for-loop
  path but with fp32 maths for bf16/fp16 params.  It is used for tensors the kernels cannot walk
  as flat arrays (non-dense layouts) and when a compiled backend is missing.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _backend as B
from . import _plan as P
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


# fused_adam's positional lists, as _init_group fills them.
_LIST_KEYS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps",
              "master_params")
# Table names of a plan, in the order of the kernels' arguments after params and grads.
_ADAM_SLOTS = ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params", "state_steps")
_ADAM_STATE_KEYS = {"exp_avgs": "exp_avg", "exp_avg_sqs": "exp_avg_sq",
                    "max_exp_avg_sqs": "max_exp_avg_sq", "master_params": "master_param",
                    "state_steps": "step"}


def _adam_plan(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
               exp_avg_sqs: List[Tensor], max_exp_avg_sqs: List[Optional[Tensor]],
               master_params: List[Optional[Tensor]], state_steps: List[Tensor],
               **cache_args: Any) -> P.Plan:
    return P.Plan(params, grads, dict(zip(_ADAM_SLOTS, (
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps))),
        master_slot="master_params", **cache_args)


def _launch_adam(
    plan: P.Plan, *, amsgrad: bool, beta1: float, beta2: float, lr: float, weight_decay: float,
    eps: float, maximize: bool, decoupled_weight_decay: bool, grad_scale: Optional[Tensor],
    found_inf: Optional[Tensor],
) -> None:
    """One kernel call per (dtype, master-weights) bucket of the plan.  On CPU the caller has
    already checked ``found_inf`` on the host; CUDA kernels check it on the device."""
    if not plan.cuda:
        gs = 0.0 if grad_scale is None else to_float(grad_scale)
        threads = B.num_threads()
        for b in plan.buckets:
            t = b.tables
            B.cpu_ext.adam(
                t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sqs"],
                t["max_exp_avg_sqs"] if amsgrad else [], t["master_params"], t["state_steps"],
                b.numels, b.dtype_code, lr, beta1, beta2, eps, weight_decay,
                decoupled_weight_decay, amsgrad, maximize, gs, threads)
        return
    device = plan.device
    lib = B.cuda_lib()
    gs_ptr, _gs_keep = B.scalar_ptr(grad_scale, device)
    fi_ptr, _fi_keep = B.scalar_ptr(found_inf, device)
    stream = B.cuda_stream(device)
    with torch.cuda.device(device):
        for b in plan.buckets:
            a = b.arrays
            rc = lib.aiak_fused_adam_cuda(
                len(b.numels), b.c_numels, a["params"], a["grads"], a["exp_avgs"],
                a["exp_avg_sqs"], a["max_exp_avg_sqs"] if amsgrad else None, a["master_params"],
                a["state_steps"], b.dtype_code, lr, beta1, beta2, eps, weight_decay,
                int(decoupled_weight_decay), int(amsgrad), int(maximize), gs_ptr, fi_ptr, stream)
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
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        plan = _adam_plan(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                          pick(max_exp_avg_sqs), pick(master_params), pick(state_steps))
        _launch_adam(plan, amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr,
                     weight_decay=weight_decay, eps=eps, maximize=maximize,
                     decoupled_weight_decay=decoupled_weight_decay, grad_scale=grad_scale,
                     found_inf=found_inf)

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
        """Update every parameter that has a gradient (see :meth:`step`).

        Each group's kernel tables come from a cached plan (see _plan.py) when they still
        describe the group; otherwise the group is gathered parameter by parameter, as torch
        does, and a new plan is cached when every tensor can go through the kernels."""
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler
        found_inf = getattr(self, "found_inf", None)
        cache = P.plans_of(self)
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            hyper = dict(amsgrad=group["amsgrad"], beta1=to_float(beta1), beta2=to_float(beta2),
                         lr=to_float(group["lr"]), weight_decay=to_float(group["weight_decay"]),
                         eps=float(group["eps"]), maximize=group["maximize"],
                         decoupled_weight_decay=group["decoupled_weight_decay"],
                         grad_scale=grad_scale, found_inf=found_inf)
            flags = (bool(group["amsgrad"]), bool(group.get("master_weights", False)))
            plan, key = cache.lookup(index, group["params"], self.state, flags)
            if plan is None:
                lists = self._gather(group)
                plan = self._new_plan(lists, key, flags, group)
                if plan is None:
                    fused_adam(*(lists[k] for k in _LIST_KEYS), **hyper)
                    continue
                cache.store(plan)
            if not plan.cuda and found_inf is not None and to_float(found_inf) != 0.0:
                continue  # the CPU kernels skip on the host, like fused_adam
            try:
                _launch_adam(plan, **hyper)
            except B.CudaKernelsUnusable as err:  # at the first launch, before any write
                B.mark_cuda_unusable(plan.device, err)
                cache.clear()
                lists = self._gather(group)
                fused_adam(*(lists[k] for k in _LIST_KEYS), **hyper)

    def _gather(self, group: Dict[str, Any]) -> Dict[str, list]:
        """The group's tensors as fused_adam's lists, creating missing state."""
        lists: Dict[str, list] = {k: [] for k in _LIST_KEYS}
        self._init_group(group, lists)
        return lists

    def _new_plan(self, lists: Dict[str, list], key: Any, flags: Tuple,
                  group: Dict[str, Any]) -> Optional[P.Plan]:
        """A plan for the gathered group, or None when some tensor needs the reference path."""
        params = lists["params"]
        amsgrad = flags[0]
        per_position = [
            [t for t in ts if t is not None] for ts in zip(
                params, lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
                lists["max_exp_avg_sqs"] if amsgrad else [None] * len(params),
                lists["master_params"])]
        if not P.plannable(params[0].device if params else torch.device("cpu"), per_position):
            return None
        keys = dict(_ADAM_STATE_KEYS)
        if not amsgrad:
            del keys["max_exp_avg_sqs"]
        return _adam_plan(params, lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
                          lists["max_exp_avg_sqs"], lists["master_params"], lists["state_steps"],
                          state_keys=keys, key=key, flags=flags, state=self.state,
                          group_params=group["params"])


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
