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
from typing import Any, Iterator, Optional, Tuple

import torch

from aiak_training.torch.mpi_ops import Adasum, allreduce_async_, synchronize
from aiak_training.torch.optim.wrapper import DistributedWrapper, NamedParameters

_SKIP_SYNCHRONIZE = ("skip_synchronize() is not supported with op=Adasum: each parameter is "
                     "stepped before its update is reduced, so there is nothing to skip.")


class AdasumDeltaStrategy(DistributedWrapper):
    """The Adasum delta strategy of the distributed-optimizer wrapper (see ``wrapper.py``;
    ``DistributedOptimizer`` picks it for ``op=Adasum``)."""

    def __init__(self, params: Any, named_parameters: Optional[NamedParameters],
                 compression: Any, backward_passes_per_step: int):
        super().__init__(params, named_parameters, backward_passes_per_step, Adasum)
        self._compression = compression
        # Each parameter's value before its local step: the base the reduced delta goes on.
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False)
                                 for p in self._parameter_names}
        self._register_hooks()

    # ---- hooks ----------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        for p in self._trainable():
            if p.grad is None:
                # As Horovod: a gradient exists from the start, so a parameter the forward
                # pass skipped still steps (on zeros) and takes part in the reduction.
                p.grad = p.data.new_zeros(p.size())
            self._requires_update.add(p)
            self._grad_accs.append(self._attach_hook(p))

    def _gradient_ready(self, p: torch.Tensor) -> None:
        if self._count_pass(p):
            self._handles[p] = self._step_and_reduce(p)
        else:
            self._handles[p] = (None, None)

    # ---- the local step and the reduction of its delta ------------------------------------
    def _step_and_reduce(self, p: torch.Tensor) -> Tuple[int, Any]:
        """Step ``p`` alone with the wrapped optimizer, leave ``p - start`` in ``p`` and start
        its Adasum allreduce."""
        start = self._starting_models[p]
        start.copy_(p.data)
        self._step_only([p])
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
            self._passes.rearm(p)
        self._handles.clear()
        return loss
