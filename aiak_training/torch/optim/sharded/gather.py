"""The allgather of the updated shards, overlapped with the next forward pass.

``step()`` starts one allgather per bucket, which writes the other ranks' updated slices
straight into the parameters' storage.  With :meth:`GatherOverlap.overlap_allgather` they are
waited for by forward pre-hooks of the modules owning the parameters, so they overlap the
next forward pass; everything else that reads or writes the parameters waits first.
"""
from __future__ import annotations

import weakref
from typing import Iterable, List, Optional

import torch

from aiak_training.torch.mpi_ops import synchronize
from aiak_training.torch.optim.sharded.buckets import Bucket

# Sharded optimizers whose step() may have left allgathers in flight (overlap_allgather).
_OVERLAPPED: "weakref.WeakSet[GatherOverlap]" = weakref.WeakSet()


def wait_for_all_parameters() -> None:
    """Finish every sharded optimizer's allgathers still in flight: for code that reads
    parameters outside the model's hooks (``hvd.broadcast_parameters``)."""
    for optimizer in list(_OVERLAPPED):
        optimizer.wait_for_parameters()


class GatherOverlap:
    """Waiting for the allgathers ``step()`` started (a part of :class:`ShardedStrategy`,
    which supplies the fields)."""

    def _wait(self, buckets: Iterable[Bucket]) -> None:
        """Wait until the allgathers of ``buckets`` (those still pending) have written the
        parameters.  Every rank started all of them in ``step()``, so waiting for any one,
        in any order, never waits for a rank that has not got there: no deadlock, whatever
        order the forward pass asks in."""
        for b in buckets:
            handle = self._gathers.pop(b, None)
            if handle is not None:
                synchronize(handle)

    def _pending_gathers(self) -> List[Bucket]:
        """Buckets whose updated values are not all in the parameters yet."""
        return list(self._gathers)

    def wait_for_parameters(self) -> None:
        """Wait until the parameters hold the values of the last ``step()``.  Every method of
        this optimizer that reads or writes them calls it; call it before reading parameters
        outside a forward pass of the model given to :meth:`overlap_allgather` (not needed
        for ``model.state_dict()``/``load_state_dict()``, which wait by themselves)."""
        self._wait(self._pending_gathers())

    def overlap_allgather(self, model: Optional[torch.nn.Module]) -> None:
        """Let the allgather of the updated parameters overlap the next forward pass of
        ``model`` (None: turn that off, and wait in ``step()`` again).

        ``step()`` then returns once the allgathers have started; each module of ``model``
        that owns parameters of this optimizer waits, in a forward pre-hook, for the buckets
        holding them, and so do its ``state_dict()`` and ``load_state_dict()``.  A forward
        that uses parameters of a module other than its own raises ``RuntimeError`` in
        backward unless :meth:`wait_for_parameters` ran first."""
        self.wait_for_parameters()
        for hook in self._model_hooks:
            hook.remove()
        self._model_hooks = []
        _OVERLAPPED.discard(self)
        self._gather_order = list(self._buckets)
        if model is None:
            return
        order: List[Bucket] = []  # buckets in the order the model's modules come
        for module in model.modules():
            owned = {self._bucket_of[p] for p in module.parameters(recurse=False)
                     if p in self._bucket_of}
            if not owned:
                continue
            mine = [b for b in self._buckets if b in owned]  # a fixed order
            order += [b for b in mine if b not in order]
            wait = lambda *_args, _mine=mine, **_kwargs: self._wait(_mine)  # noqa: E731
            self._model_hooks += [module.register_forward_pre_hook(wait),
                                  module.register_state_dict_pre_hook(wait),
                                  module.register_load_state_dict_pre_hook(wait)]
        if not self._model_hooks:
            raise ValueError("overlap_allgather: the model owns none of this optimizer's "
                             "trainable parameters.")
        # Gather in the order the forward pass is likely to use them (module registration
        # order), so that the few allgathers in flight are the ones needed next.  The order
        # is a function of the model only: the same on every rank.
        self._gather_order = order + [b for b in self._buckets if b not in order]
        _OVERLAPPED.add(self)

    def zero_grad(self, *args, **kwargs):
        self.wait_for_parameters()
        return super().zero_grad(*args, **kwargs)
