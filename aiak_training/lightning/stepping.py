"""How a Lightning optimizer step drives a ``DistributedOptimizer``.

Lightning hands the strategy a closure (forward, backward) and lets the precision plugin pass
it to ``optimizer.step(closure=...)``, after which it runs the ``on_before_optimizer_step``
hooks and gradient clipping.  A ``DistributedOptimizer`` however waits for the gradients'
allreduces when ``step()`` *starts*, before a closure would produce them.  So:

* the usual path runs the closure, then ``synchronize()`` (hooks and clipping see averaged
  gradients, as under DDP), and steps inside ``skip_synchronize()``;
* with ``overlap_update`` on and nothing that needs the averaged gradients before the step
  (no clipping, no ``configure_gradient_clipping`` or ``on_before_optimizer_step`` override,
  the plain precision plugin), the closure runs first and ``step()`` is then called without
  one, so the update of each bucket overlaps the reductions still in flight;
* Adasum's optimizer evaluates a closure itself before stepping: it gets it unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from aiak_training.torch.optim.adasum import AdasumDeltaStrategy

# LightningModule hooks whose override means "I look at the gradients before the step".
_GRADIENT_HOOKS = ("configure_gradient_clipping", "on_before_optimizer_step")


class ClosureRunner:
    """Stands in for the optimizer while the precision plugin runs the closure and its hooks:
    ``step(closure)`` only evaluates the closure; everything else is the real optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self, closure: Optional[Callable[[], Any]] = None, **_kwargs: Any) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def is_distributed(optimizer: Any) -> bool:
    """Whether ``optimizer`` came from aiak-training's ``DistributedOptimizer``."""
    return bool(getattr(type(optimizer), "_aiak_distributed", False))


def _overrides(module: Any, hook: str, base: type) -> bool:
    return getattr(type(module), hook, None) is not getattr(base, hook, None)


def overlap_applies(optimizer: Any, module: Any, module_base: type, precision: Any,
                    precision_base: type, clip_val: Any) -> bool:
    """Whether this step may run as an overlapped update (module docstring)."""
    if getattr(optimizer, "_overlap", None) is None:
        return False
    if clip_val:
        return False
    if any(_overrides(module, hook, module_base) for hook in _GRADIENT_HOOKS):
        return False
    return type(precision).optimizer_step is precision_base.optimizer_step


def step(optimizer: Any, closure: Callable[[], Any], run_plugin: Callable[[Any, Callable], Any],
         overlap: bool, **kwargs: Any) -> Any:
    """One optimizer step of ``optimizer`` (a ``DistributedOptimizer``).

    ``run_plugin(optimizer_like, closure)`` is Lightning's own step through the precision
    plugin; ``overlap`` comes from :func:`overlap_applies`."""
    if isinstance(optimizer, AdasumDeltaStrategy):
        return run_plugin(optimizer, closure)
    if overlap:
        result = run_plugin(ClosureRunner(optimizer), closure)
        optimizer.step(**kwargs)
        return result

    def synchronized_closure() -> Any:
        result = closure()
        optimizer.synchronize()
        return result

    with optimizer.skip_synchronize():
        return run_plugin(optimizer, synchronized_closure)
