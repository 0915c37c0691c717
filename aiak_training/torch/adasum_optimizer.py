"""``DistributedOptimizer(op=hvd.Adasum)`` on more than one rank: the delta optimizer.

Adasum combines *model updates*, not gradients (Horovod 0.28.1's ``_DistributedAdasumOptimizer``
behaves this way, and so does this class).  Per parameter ``p``:

1. when ``p``'s gradient is ready (the ``backward_passes_per_step``-th backward pass since the
   last step), the wrapped optimizer steps ``p`` alone, locally: ``start = p``, ``step()``,
   ``delta = p - start``;
2. ``delta`` is Adasum-allreduced in the background (in place in ``p``'s memory, so ``p``
   holds the delta until ``step()``);
3. ``step()`` waits for every delta and sets ``p = start + Adasum(delta_0, ..., delta_n-1)``.

So momentum, Adam moments and the other optimizer state stay local to each rank, computed
from its own gradients, while the parameters stay identical on every rank.  Parameters whose
gradient was not produced in a step are stepped (and reduced) inside ``step()``.  The
learning rate is usually *not* scaled by the number of ranks with Adasum (it adapts:
orthogonal updates add up, parallel ones are averaged).

Differences from the Average/Sum optimizer, as in Horovod: ``synchronize()`` does nothing
(there are no reduced gradients to look at), ``skip_synchronize()`` raises
``AssertionError``, and ``groups``/``sparse_as_dense``/``gradient_predivide_factor`` do not
apply.  The global process set only.
"""
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from aiak_training.common import horovod_strings as hs
from aiak_training.torch.mpi_ops import Adasum, allreduce_async_, synchronize

_SKIP_SYNCHRONIZE = ("skip_synchronize() is not supported with op=Adasum: each parameter is "
                     "stepped before its update is reduced, so there is nothing to skip.")


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Methods of the subclass of the user's optimizer class that ``DistributedOptimizer``
    builds for ``op=Adasum``.  The wrapped optimizer is reached through
    ``super(type(self), self)``."""

    _aiak_distributed = True

    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 check_names: Callable[[Any, Any], List[Tuple[str, torch.Tensor]]]):
        super(type(self), self).__init__(params)
        # check_names(self, named_parameters): the Average optimizer's validation (Horovod's
        # errors), handed in by optimizer.py, which imports this module.
        named = sorted(check_names(self, named_parameters), key=lambda pair: pair[0])
        self._parameter_names = {p: name for name, p in named}
        self._compression = compression
        self.op = Adasum
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for _, p in named}
        # p -> (handle or None, compression ctx); None: passes counted, nothing started yet.
        self._handles: Dict[torch.Tensor, Tuple[Any, Any]] = {}
        self._requires_update = set()
        self._grad_accs: List[Any] = []
        # Each parameter's value before its local step: the base the reduced delta goes on.
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for _, p in named}
        self._register_hooks()

    # ---- hooks ----------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    # As Horovod: a gradient exists from the start, so a parameter the forward
                    # pass skipped still steps (on zeros) and takes part in the reduction.
                    p.grad = p.data.new_zeros(p.size())
                self._requires_update.add(p)
                self._grad_accs.append(self._attach_hook(p))

    def _attach_hook(self, p: torch.Tensor) -> Any:
        def hook(*_unused):
            self._gradient_ready(p)
        if hasattr(p, "register_post_accumulate_grad_hook"):
            return p.register_post_accumulate_grad_hook(hook)
        accumulator = p.expand_as(p).grad_fn.next_functions[0][0]  # torch < 2.1
        accumulator.register_hook(lambda *_: hook())
        return accumulator

    def _gradient_ready(self, p: torch.Tensor) -> None:
        entry = self._handles.get(p)
        if entry is not None and entry[0] is not None and self._allreduce_delay[p] <= 0:
            raise AssertionError(hs.TOO_MANY_BACKWARD_PASSES)
        assert self._allreduce_delay[p] > 0
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] == 0:
            self._handles[p] = self._step_and_reduce(p)
        else:
            self._handles[p] = (None, None)

    # ---- the local step and the reduction of its delta ------------------------------------
    def _step_and_reduce(self, p: torch.Tensor) -> Tuple[int, Any]:
        """Step ``p`` alone with the wrapped optimizer, leave ``p - start`` in ``p`` and start
        its Adasum allreduce."""
        start = self._starting_models[p]
        # The wrapped step() updates every parameter of its groups: show it only ``p``.
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(p is q for q in group["params"]) else []
            start.copy_(p.data)
            super(type(self), self).step()
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        p.data.sub_(start)
        payload, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(payload, name=self._parameter_names.get(p), op=Adasum)
        return handle, ctx

    def synchronize(self) -> None:
        """Nothing to do: with Adasum, ``step()`` collects the reduced updates."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(_SKIP_SYNCHRONIZE)
        yield  # pragma: no cover - a generator, for the contextmanager decorator

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        # Sorted by name, so every rank starts the missing reductions in the same order.
        for p in sorted(self._requires_update - set(self._handles), key=self._parameter_names.get):
            self._handles[p] = self._step_and_reduce(p)
        for p in sorted(self._handles, key=self._parameter_names.get):
            handle, ctx = self._handles[p]
            if handle is None:  # step() came before backward_passes_per_step passes
                handle, ctx = self._step_and_reduce(p)
            reduced = self._compression.decompress(synchronize(handle), ctx)
            # new parameter = value before the local step + the combined update
            base = self._starting_models[p]
            torch.add(base, reduced.data, out=p.data)
            base.copy_(p.data)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self, *args, **kwargs):
        # p holds its delta, being reduced in place, until step(): refuse to race with it.
        if self._handles:
            raise AssertionError(hs.ZERO_GRAD_RACE)
        return super(type(self), self).zero_grad(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated per step; restarts the count."""
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super(type(self), self).load_state_dict(*args, **kwargs)


def distributed_adasum_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Any],
                                 compression: Any, backward_passes_per_step: int,
                                 check_names: Callable[[Any, Any], List[Tuple[str, torch.Tensor]]]
                                 ) -> torch.optim.Optimizer:
    """The delta optimizer around ``optimizer`` (see the module docstring): an instance of a
    subclass of ``type(optimizer)`` sharing its param groups, with its state carried over.
    ``check_names(opt, named_parameters)`` validates the names as the Average optimizer does."""
    base = optimizer.__class__
    cls = type(base.__name__, (base,), dict(_DistributedAdasumOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
                  check_names)
    for p, s in optimizer.state.items():
        wrapped.state[p] = s
    wrapped.defaults.update(optimizer.defaults)
    return wrapped
