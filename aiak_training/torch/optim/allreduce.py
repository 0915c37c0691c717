"""The allreduce strategy of ``DistributedOptimizer``: averages gradients across ranks as
they are produced.

Hooks fire as each gradient is accumulated and start an asynchronous in-place allreduce;
``step()`` waits for them (``synchronize()``) and then runs the wrapped optimizer.  With
``overlap_update`` on, ``step()`` instead updates each bucket of parameters as soon as its
reduction completes, while the others are still being reduced (see ``overlap.py``).
``DistributedOptimizer`` itself, which picks the strategy, is in ``optim/__init__.py``.

In-flight reductions live in ``_handles``: a parameter, or a tuple of parameters for an
explicit group, maps to ``(handle, ctx)``.  A handle of None records a backward pass that did
not start a reduction yet (more passes to accumulate, or a group still incomplete).
"""
import itertools
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from aiak_training.common import horovod_strings as hs
from aiak_training.common.grouping import group_positions
from aiak_training.runtime.sets.process_sets import global_process_set
from aiak_training.torch.mpi_ops import (Average, allreduce_async_, grouped_allreduce_async_,
                                         size, sparse_allreduce_async, synchronize)
from aiak_training.torch.optim import overlap as _overlap
from aiak_training.torch.optim.wrapper import DistributedWrapper

Groups = Union[int, List[List[torch.Tensor]]]


def _check_groups(groups: Optional[Groups]) -> None:
    if groups is None:
        return
    if not isinstance(groups, list):
        if not groups > 0:
            raise ValueError(hs.GROUPS_TYPE)
        return
    seen = set()
    for tensor in itertools.chain.from_iterable(groups):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(hs.GROUPS_NOT_TENSORS)
        if id(tensor) in seen:
            raise ValueError(hs.GROUPS_REPEATED_PARAMETER)
        seen.add(id(tensor))


def _zeros_if_missing(p: torch.Tensor) -> None:
    # A rank whose forward skipped this parameter still has to take part in the collective
    # under its name (other ranks may have a gradient); zeros leave their sum unchanged.
    if p.grad is None:
        p.grad = p.data.new_zeros(p.size())


class _DistributedOptimizer(DistributedWrapper):
    """The allreduce strategy (Horovod's ``_DistributedOptimizer``): each gradient is
    reduced in the background from its hook; ``step()`` waits and runs the wrapped optimizer.
    Shared machinery (names, passes, hooks, the wrapped step) is in ``wrapper.py``."""

    _aiak_overlap_ok = True

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, groups=None,
                 sparse_as_dense=False, process_set=global_process_set,
                 overlap_update: Optional[bool] = None):
        super().__init__(params, named_parameters, backward_passes_per_step, op, process_set)
        self._compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.gradient_predivide_factor = gradient_predivide_factor

        _check_groups(groups)
        self._groups = groups
        self._p_to_group: Dict = {}
        self._group_counts: Dict = {}

        # One rank has nothing to reduce, except under elastic training, where more may join.
        multi_rank = size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"
        if self.process_set.included() and multi_rank:
            self._register_hooks()

        # Overlapped update (None: off).  Decided once here; each step may still fall back.
        if _overlap.requested(overlap_update):
            reason, check = _overlap.Overlap.static_reason(self)
            if reason is None:
                self._overlap = _overlap.Overlap(check)
            else:
                _overlap.log_fallback_once(set(), reason)

    # ---- hooks --------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        trainable = [p for group in self.param_groups for p in group["params"]
                     if p.requires_grad]
        if self._groups is not None:
            self._form_groups(trainable)
        for p in trainable:
            self._requires_update.add(p)
            self._grad_accs.append(self._attach_hook(p))

    def _form_groups(self, trainable: List[torch.Tensor]) -> None:
        """Fill ``_p_to_group``/``_group_counts``.  Members are ordered by name, so every rank
        forms the same groups whatever order its param groups list them in."""
        ordered = sorted(trainable, key=self._parameter_names.get)
        # As Horovod: a listed tensor that is not a parameter with a gradient (frozen, or not
        # in this optimizer) is left out of its group; positions are name order.
        chunks = group_positions(list(range(len(ordered))), self._groups,
                                 lambda i: id(ordered[i]), id)
        for chunk in chunks:
            members = tuple(ordered[i] for i in chunk)
            self._group_counts[members] = 0
            self._p_to_group.update(dict.fromkeys(members, members))

    def _gradient_ready(self, p: torch.Tensor) -> None:
        last = self._count_pass(p)
        assert not p.grad.requires_grad
        if not last:
            self._handles[p] = (None, None)
        elif self._groups is None:
            self._handles[p] = self._allreduce_grad_async(p)
        else:
            members = self._p_to_group[p]
            self._group_counts[members] += 1
            if self._group_counts[members] == len(members):
                self._start_group(members)
            else:
                self._handles[p] = (None, None)

    # ---- starting reductions --------------------------------------------------------------
    def _allreduce_grad_async(self, p: torch.Tensor) -> Tuple[Any, Any]:
        _zeros_if_missing(p)
        name = self._parameter_names.get(p)
        grad = p.grad
        if grad.is_sparse:
            if not self.sparse_as_dense:
                return self._sparse_allreduce_grad_async(p, name)
            grad = grad.to_dense()
        payload, ctx = self._compression.compress(grad)
        pre, post = self._scale_factors()
        handle = allreduce_async_(payload, name=name, op=self.op, prescale_factor=pre,
                                  postscale_factor=post, process_set=self.process_set)
        return handle, ctx

    def _grouped_allreduce_grad_async(self, ps: Tuple[torch.Tensor, ...]) -> Tuple[Any, Any]:
        # One engine request named after the group's first member.  As in Horovod, groups
        # get no pre/postscaling: gradient_predivide_factor does not apply to them.
        packed = [self._compression.compress(p.grad) for p in ps]
        handle = grouped_allreduce_async_([tensor for tensor, _ in packed],
                                          name=self._parameter_names.get(ps[0]), op=self.op,
                                          process_set=self.process_set)
        return handle, tuple(ctx for _, ctx in packed)

    def _sparse_allreduce_grad_async(self, p: torch.Tensor, name: str) -> Tuple[Any, None]:
        reduce_later = sparse_allreduce_async(p.grad, name=name, op=self.op,
                                              process_set=self.process_set)
        return reduce_later, None

    def _start_group(self, members: Tuple[torch.Tensor, ...]) -> None:
        self._handles[members] = self._grouped_allreduce_grad_async(members)
        # The members' own entries only recorded their passes; the group's entry replaces them.
        for p in members:
            self._handles.pop(p, None)
        self._group_counts[members] = 0

    def _submit_pending(self) -> None:
        """Start every allreduce the hooks did not: parameters whose gradient was not produced
        (reduced as zeros, since other ranks may have produced theirs), incomplete groups, and
        passes that ended before ``backward_passes_per_step`` was reached."""
        seen = set()
        for key in self._handles:
            seen.update(key if isinstance(key, tuple) else (key,))
        absent = self._requires_update - seen
        # Sorted by name: every rank must submit in the same order.
        for p in sorted(absent, key=self._parameter_names.get):
            if p not in self._p_to_group:
                self._handles[p] = self._allreduce_grad_async(p)
        if self._groups is not None:
            # A group that did not complete (some gradients missing) is still reduced as one.
            for members, count in self._group_counts.items():
                if members in self._handles:
                    continue
                if count or not absent.isdisjoint(members):
                    for p in members:
                        _zeros_if_missing(p)
                    self._start_group(members)
        for key, (handle, _) in list(self._handles.items()):
            if handle is None:
                self._handles[key] = self._allreduce_grad_async(key)

    # ---- collecting results -------------------------------------------------------------
    def _finish_reduction(self, p, handle, ctx) -> None:
        """Wait for one handle and put the reduced gradient(s) in place (``p`` is a parameter,
        or a tuple of them for a grouped allreduce)."""
        if isinstance(p, tuple):
            for member, reduced, member_ctx in zip(p, synchronize(handle), ctx):
                self._passes.rearm(member)
                member.grad.set_(self._compression.decompress(reduced, member_ctx))
            return
        # A sparse reduction hands back a function that yields the result, not an engine handle.
        reduced = handle() if callable(handle) else synchronize(handle)
        self._passes.rearm(p)
        result = self._compression.decompress(reduced, ctx)
        if not p.grad.is_sparse:
            p.grad.set_(result)
            return
        if not result.is_sparse:  # sparse_as_dense: it travelled as a dense tensor
            result = result.to_sparse()
        # set_() is not available on sparse tensors; overwrite through zero_() and add_().
        p.grad.zero_().add_(result)

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and put the averaged gradients in place.

        Called by ``step()``; call it yourself before modifying gradients (e.g. clipping),
        then run ``step()`` inside ``skip_synchronize()``.
        """
        if self.process_set.included():
            self._submit_pending()
            for key, (handle, ctx) in self._handles.items():
                self._finish_reduction(key, handle, ctx)
            self._handles.clear()
        self._synchronized = True

    def step(self, closure=None):
        if self._handles and self._should_synchronize and not self._synchronized \
                and (getattr(self, "grad_scale", None) is not None
                     or getattr(self, "found_inf", None) is not None):
            # GradScaler.step() checks the gradients for inf/NaN (and writes them back) before
            # it calls step(): here that check raced the allreduces still in flight, so ranks
            # can disagree about skipping the step.
            warnings.warn(GRAD_SCALER_BEFORE_SYNC)
        wrapped_step = self._wrapped_step
        overlap = self._overlap
        if overlap is not None:
            overlap.stats.steps += 1
            # With nothing to reduce (single rank, or not in the set) the plain step runs.
            if self.process_set.included() and self._requires_update:
                reason = overlap.step_reason(self, closure)
                if reason is None:
                    self._synchronized = False
                    overlap.step(self, wrapped_step)
                    return None
                overlap.fallback(reason)
        self._synchronize_for_step()
        return wrapped_step(closure)


GRAD_SCALER_BEFORE_SYNC = (
    "GradScaler checked the gradients for inf/NaN while their allreduce was still running, so "
    "the check saw unreduced gradients and may differ between ranks. Call "
    "optimizer.synchronize() before scaler.step(optimizer) and run scaler.step(optimizer) "
    "inside optimizer.skip_synchronize().")
