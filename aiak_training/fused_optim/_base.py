"""Behaviour shared by every fused optimizer: input checks, state layout, checkpoint loading."""
from __future__ import annotations

import itertools
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from ._backend import LOW_PRECISION, SUPPORTED_DEVICE_TYPES, SUPPORTED_DTYPES, state_dtype, to_float


class FusedOptimizerBase(torch.optim.Optimizer):
    """Base class: param-group checks, fp32 state for low-precision params, state_dict loading.

    Subclasses set ``_state_keys``: the per-parameter state tensors that are kept in
    :func:`state_dtype` (fp32, or fp64 for fp64 params) whatever dtype a loaded checkpoint has.
    """

    _state_keys: Tuple[str, ...] = ()
    # torch.amp.GradScaler hands us grad_scale/found_inf instead of unscaling and syncing itself.
    _step_supports_amp_scaling = True

    # ------------------------------------------------------------------------- param groups
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group (see torch.optim.Optimizer) after checking devices and dtypes."""
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    def _check_group(self, group: Dict[str, Any]) -> None:
        name = type(self).__name__
        params = group["params"]
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise ValueError(
                f"{name}: all parameters of one param group must be on the same device, found "
                f"{', '.join(devices)}. Put parameters on different devices into separate param "
                f"groups.")
        for p in params:
            if p.device.type not in SUPPORTED_DEVICE_TYPES:
                raise ValueError(f"{name} supports CPU and CUDA tensors; got a parameter on {p.device}.")
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"{name} supports float32, float64, float16 and bfloat16 parameters; got {p.dtype}.")

    def _check_grad(self, p: torch.Tensor) -> torch.Tensor:
        """Return p.grad after checking it can go through the fused kernels."""
        g = p.grad
        if not g.is_sparse and g.dtype == p.dtype and g.shape == p.shape and g.device == p.device:
            return g  # the common case, checked cheaply
        name = type(self).__name__
        if g.is_sparse:
            raise RuntimeError(
                f"{name} does not support sparse gradients; use torch.optim.SparseAdam or make "
                f"the gradient dense (e.g. nn.Embedding(sparse=False)).")
        if g.dtype != p.dtype:
            raise TypeError(f"{name}: gradient dtype {g.dtype} differs from parameter dtype {p.dtype}.")
        if g.device != p.device:
            raise ValueError(f"{name}: gradient is on {g.device} but its parameter is on {p.device}.")
        if g.shape != p.shape:
            raise ValueError(f"{name}: gradient shape {tuple(g.shape)} differs from parameter shape "
                             f"{tuple(p.shape)}.")
        return g

    # ------------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Optional[Any]:
        """Perform a single optimization step (optionally re-evaluating ``closure``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._fused_step()
        return loss

    def _fused_step(self) -> None:
        """Update every parameter that has a gradient (implemented by each optimizer)."""
        raise NotImplementedError

    @torch.no_grad()
    def step_params(self, params: Iterable[torch.Tensor]) -> None:
        """Update only ``params`` (those with a gradient), each with its own param group's
        hyper-parameters and its own step count; the other parameters are not touched.

        This is what stepping one gradient bucket at a time needs (e.g. overlapping the update
        with communication).  It runs this class's own update even when a wrapper (such as
        ``DistributedOptimizer``) overrides ``step()``.  For FusedLAMB, gradient clipping then
        uses the norm of the given parameters' gradients only.
        """
        wanted = {id(p) for p in params}
        saved = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = [p for p in g["params"] if id(p) in wanted]
            self._fused_step()  # not step(): a wrapper's step() may do more (e.g. allreduce)
        finally:
            for g, ps in zip(self.param_groups, saved):
                g["params"] = ps

    # ---------------------------------------------------------------------------- state
    @staticmethod
    def _new_step(p: torch.Tensor) -> torch.Tensor:
        """Per-parameter step counter: float32 scalar on the parameter's device.

        On CPU this is what torch.optim keeps; on CUDA it is what torch's fused/capturable
        modes keep, and the kernels read and advance it on the device."""
        return torch.zeros((), dtype=torch.float32, device=p.device)

    @staticmethod
    def _zeros_state(p: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(p, dtype=state_dtype(p.dtype), memory_format=torch.preserve_format)

    @staticmethod
    def _master_for(group: Dict[str, Any], state: Dict[str, Any], p: torch.Tensor) -> Optional[torch.Tensor]:
        """fp32 master copy of a bf16/fp16 param when the group asks for master weights."""
        if not group.get("master_weights", False) or p.dtype not in LOW_PRECISION:
            return None
        master = state.get("master_param")
        if master is None:
            master = p.detach().to(torch.float32, copy=True)
            state["master_param"] = master
        return master

    def _normalize_state(self, p: torch.Tensor, state: Dict[str, Any]) -> None:
        """Bring a loaded state to the layout the kernels expect (step: float32 tensor on the
        param's device; state tensors: fp32/fp64 on the param's device)."""
        step = state.get("step")
        if step is not None and not (torch.is_tensor(step) and step.dtype == torch.float32
                                     and step.device == p.device and step.dim() == 0):
            state["step"] = torch.tensor(to_float(step), dtype=torch.float32, device=p.device)
        for key in self._state_keys + ("master_param",):
            v = state.get(key)
            if torch.is_tensor(v):
                want = torch.float32 if key == "master_param" else state_dtype(p.dtype)
                if v.dtype != want or v.device != p.device:
                    state[key] = v.to(device=p.device, dtype=want)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # load_state_dict() passes no defaults (the live ones stay); unpickling passes them.
        own = dict(state.get("defaults", self.__dict__.get("defaults")) or {})
        super().__setstate__(state)
        # torch's __setstate__ adds "differentiable" to the defaults of every optimizer, for its
        # own classes' step().  A class without that option (FusedLAMB) must not gain it: the
        # loaded param groups would then differ from a fresh optimizer's, and a state_dict
        # saved after a resume would not equal one saved by an uninterrupted run.
        if "differentiable" not in own:
            self.defaults.pop("differentiable", None)
        # Groups loaded from a torch.optim checkpoint lack our own keys (e.g. master_weights).
        for group in self.param_groups:
            for key, value in own.items():
                group.setdefault(key, value)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state_dict from this class or from the matching torch.optim class.

        torch casts every floating state tensor to the parameter's dtype while loading; for
        bf16/fp16 params we re-take the saved tensors so fp32 states keep their precision.
        """
        saved_groups = state_dict["param_groups"]
        id_map = dict(zip(
            itertools.chain.from_iterable(g["params"] for g in saved_groups),
            itertools.chain.from_iterable(g["params"] for g in self.param_groups)))
        super().load_state_dict(state_dict)
        for old_id, p in id_map.items():
            saved = state_dict["state"].get(old_id)
            state = self.state.get(p)
            if saved is None or state is None:
                continue
            if p.dtype in LOW_PRECISION:
                for key in self._state_keys + ("master_param",):
                    v = saved.get(key)
                    if torch.is_tensor(v):
                        state[key] = v.to(device=p.device, dtype=torch.float32)
            self._normalize_state(p, state)
