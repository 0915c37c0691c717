"""Swapping plain torch optimizers for their fused versions without touching the script.

``DistributedOptimizer`` calls :func:`maybe_fuse` on the optimizer it wraps.  With
``AIAK_FUSED_OPTIMIZER=1`` in the environment, a plain ``torch.optim.Adam``, ``AdamW`` or
``SGD`` is replaced by ``FusedAdam``, ``FusedAdamW`` or ``FusedSGD`` over the same param groups
and hyper-parameters, with any existing state carried over through ``state_dict``.
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Type

import torch

from aiak_training.common.env import env_bool
from aiak_training.common.tuning import FUSED_OPTIMIZER

from ._backend import SUPPORTED_DEVICE_TYPES, SUPPORTED_DTYPES
from .adam import FusedAdam, FusedAdamW
from .sgd import FusedSGD

__all__ = ["maybe_fuse", "fused_class_for", "ENV_VAR"]

ENV_VAR = FUSED_OPTIMIZER.variable

# Exact types only: a user subclass may override step() with its own maths.
_EQUIVALENT: Dict[type, Type[torch.optim.Optimizer]] = {
    torch.optim.Adam: FusedAdam,
    torch.optim.AdamW: FusedAdamW,
    torch.optim.SGD: FusedSGD,
}


def _enabled() -> bool:
    return env_bool(ENV_VAR)


def fused_class_for(optimizer: torch.optim.Optimizer) -> Optional[Type[torch.optim.Optimizer]]:
    """The fused class that can stand in for ``optimizer``'s exact type, or None."""
    return _EQUIVALENT.get(type(optimizer))


def _unsupported_reason(optimizer: torch.optim.Optimizer) -> Optional[str]:
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            return f"param group {i} uses differentiable=True"
        devices = {p.device for p in group["params"]}
        if len(devices) > 1:
            return f"param group {i} mixes devices {sorted(str(d) for d in devices)}"
        for p in group["params"]:
            if p.device.type not in SUPPORTED_DEVICE_TYPES:
                return f"a parameter is on {p.device}"
            if p.dtype not in SUPPORTED_DTYPES:
                return f"a parameter has dtype {p.dtype}"
    return None


def maybe_fuse(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Return the fused equivalent of ``optimizer`` when ``AIAK_FUSED_OPTIMIZER=1``.

    Only exact ``torch.optim.Adam``, ``AdamW`` and ``SGD`` instances are replaced; anything else
    (including the fused classes themselves and user subclasses) is returned unchanged, as is
    every optimizer when the variable is unset.  The new optimizer gets the same param groups
    (same tensors, hyper-parameters and extra keys), the same ``defaults`` and a copy of the
    state via ``load_state_dict``.  If the optimizer uses something the fused classes do not
    support (``differentiable``, mixed devices in a group, other devices or dtypes), a warning
    says why and the original is returned.

    Call it before attaching LR schedulers or hooks: they hold a reference to the optimizer
    object they were given.
    """
    if not _enabled():
        return optimizer
    cls = fused_class_for(optimizer)
    if cls is None:
        return optimizer
    reason = _unsupported_reason(optimizer)
    if reason is not None:
        warnings.warn(f"{ENV_VAR}=1: keeping {type(optimizer).__name__} because {reason}",
                      RuntimeWarning, stacklevel=2)
        return optimizer
    groups = []
    for group in optimizer.param_groups:
        g = dict(group)
        g["params"] = list(group["params"])
        groups.append(g)
    fused = cls(groups)
    fused.defaults.update(optimizer.defaults)  # later add_param_group() calls see the same defaults
    fused.load_state_dict(optimizer.state_dict())
    return fused
