"""DistributedOptimizer: averages gradients across ranks as they are produced.

Hooks fire as each gradient is accumulated and start an asynchronous in-place allreduce;
``step()`` waits for them (``synchronize()``) and then runs the wrapped optimizer.  With
``overlap_update`` on, ``step()`` instead updates each bucket of parameters as soon as its
reduction completes, while the others are still being reduced (see ``overlap.py``).

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
from aiak_training.runtime import startup_line as _startup_line
from aiak_training.runtime.process_sets import ProcessSet, global_process_set
from aiak_training.torch import overlap as _overlap
from aiak_training.torch.compression import Compression
from aiak_training.torch.mpi_ops import (Adasum, Average, allreduce_async_,
                                         grouped_allreduce_async_, size,
                                         sparse_allreduce_async, synchronize)
from aiak_training.torch.wrapper import DistributedWrapper, NamedParameters, wrap

Groups = Union[int, List[List[torch.Tensor]]]


def _even_chunks(items: List, n: int) -> List[List]:
    """``items`` cut into ``n`` consecutive runs; the first ``len(items) % n`` are one longer."""
    base, longer = divmod(len(items), n)
    chunks, start = [], 0
    for i in range(n):
        stop = start + base + (i < longer)
        chunks.append(items[start:stop])
        start = stop
    return chunks


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
        name_of = self._parameter_names.get
        ordered = sorted(trainable, key=name_of)
        if isinstance(self._groups, int):
            chunks = _even_chunks(ordered, self._groups)
        else:
            # As Horovod: a listed tensor that is not a parameter with a gradient (frozen,
            # or not in this optimizer) is left out of its group.
            eligible = {id(p) for p in ordered}
            chunks = [sorted((t for t in listed if id(t) in eligible), key=name_of)
                      for listed in self._groups]
            placed = {id(p) for chunk in chunks for p in chunk}
            chunks.extend([p] for p in ordered if id(p) not in placed)
        for chunk in filter(None, chunks):
            members = tuple(chunk)
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
                self._rearm(member)
                member.grad.set_(self._compression.decompress(reduced, member_ctx))
            return
        # A sparse reduction hands back a function that yields the result, not an engine handle.
        reduced = handle() if callable(handle) else synchronize(handle)
        self._rearm(p)
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


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[NamedParameters] = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Optional[Groups] = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         overlap_update: Optional[bool] = None,
                         shard_optimizer_state: bool = False) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that its ``step()`` applies gradients averaged over all ranks.

    Each gradient's allreduce starts in the background as soon as ``loss.backward()`` has
    produced it, so communication overlaps the rest of the backward pass; ``step()`` waits for
    the results before updating.  To work on the averaged gradients first (clipping, say),
    call ``optimizer.synchronize()``, then step inside ``optimizer.skip_synchronize()``::

        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        with optimizer.skip_synchronize():
            optimizer.step()

    The result is an instance of a subclass of ``type(optimizer)`` sharing its param groups.

    Arguments:
        optimizer: the ``torch.optim.Optimizer`` that computes the updates.
        named_parameters: ``(name, parameter)`` pairs, usually ``model.named_parameters()``;
            the names label the reductions and must match between ranks.  Every parameter of
            the optimizer needs one.  Without it, names are generated from positions.
        compression: applied to each gradient for the transfer (``Compression.none``,
            ``Compression.fp16``); ``Compression.dgc(...)`` builds a DGC optimizer instead.
        backward_passes_per_step: backward passes whose gradients accumulate locally before
            they are reduced, i.e. between two ``step()``/``synchronize()`` calls.
        op: ``Average`` (default), ``Sum`` or ``Adasum``.  With ``Adasum`` on more than one
            rank, each rank steps with its own gradients and the parameter updates are
            Adasum-combined (see ``adasum_optimizer.py``; a power-of-two number of ranks).
        gradient_predivide_factor: with ``Average`` only: gradients are multiplied by
            ``1 / factor`` before the sum and by ``factor / size`` after it.
        num_groups: deprecated spelling of an integer ``groups``.
        groups: reduce gradients in explicit groups, each group as one request.  An integer
            splits the trainable parameters (in name order) into that many groups; a list of
            lists of tensors gives the groups, and every parameter left out is a group alone.
            None (default): no explicit groups.
        sparse_as_dense: reduce sparse gradients as dense tensors and make them sparse again
            before the update.
        process_set: the ranks to average over (default: all).
        overlap_update: If True, ``step()`` updates each bucket of parameters as soon as its
            allreduce completes, while the remaining buckets are still being reduced, with
            exactly the same results as the synchronous update.  Steps where that cannot be
            exact (``synchronize()`` called first, e.g. for gradient clipping; a closure;
            GradScaler; step hooks; sparse gradients; FusedLAMB's global norm) fall back to
            the synchronous update and log why once.  Defaults to ``AIAK_OVERLAP_UPDATE``
            (``aiakrun --overlap-update``), else off.  See ``overlap_stats()``.
        shard_optimizer_state: If True, each rank keeps the optimizer state of its shard of
            the parameters only: gradients are reduce-scattered, the optimizer steps on the
            shard, and the updated parameters are allgathered (``sharded.py``,
            docs/sharded-optimizer.md).  Checkpoints need ``consolidate_state_dict()`` on
            every rank before ``state_dict()``.

    Setting ``AIAK_FUSED_OPTIMIZER=1`` swaps a plain ``torch.optim`` Adam, AdamW or SGD for
    the matching ``aiak_training.fused_optim`` class before wrapping it.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(hs.PREDIVIDE_NEEDS_AVERAGE)
    if num_groups != 0:
        warnings.warn(hs.NUM_GROUPS_DEPRECATED, DeprecationWarning)
        groups = num_groups if groups is None else groups
    if backward_passes_per_step <= 0:
        raise ValueError(hs.BACKWARD_PASSES_POSITIVE)
    if shard_optimizer_state:
        return _sharded(optimizer, named_parameters, compression, backward_passes_per_step, op,
                        gradient_predivide_factor, groups, sparse_as_dense, process_set,
                        overlap_update)
    if op == Adasum and size() > 1:
        # On one process Horovod runs the plain optimizer, and so does this; on more, the
        # delta optimizer (adasum_optimizer.py).
        if process_set.process_set_id != global_process_set.process_set_id:
            raise NotImplementedError(hs.ADASUM_PROCESS_SETS)
        from aiak_training.torch.adasum_optimizer import AdasumDeltaStrategy
        return wrap(optimizer, AdasumDeltaStrategy, named_parameters, compression,
                    backward_passes_per_step)

    # Compressors that need their own exchange (e.g. DGC's sparse allgather) build the
    # distributed optimizer themselves.
    factory = getattr(compression, "make_distributed_optimizer", None)
    if factory is not None:
        if overlap_update and not _overlap.requested(None):
            # With AIAK_OVERLAP_UPDATE set, the base __init__ logs this itself.
            _overlap.log_fallback_once(set(), "dgc")
        if groups is not None or sparse_as_dense:
            warnings.warn("Compression.dgc exchanges each gradient on its own as sparse "
                          "(index, value) pairs: groups= and sparse_as_dense= have no effect.",
                          UserWarning, stacklevel=2)
        made = factory(optimizer, named_parameters=named_parameters,
                       backward_passes_per_step=backward_passes_per_step, op=op,
                       gradient_predivide_factor=gradient_predivide_factor,
                       process_set=process_set)
        _startup_line.announce_optimizer(made, compression, False)  # DGC steps synchronously
        return made

    if os.environ.get("AIAK_FUSED_OPTIMIZER", "") not in ("", "0"):
        from aiak_training.fused_optim import maybe_fuse
        optimizer = maybe_fuse(optimizer)

    wrapped = wrap(optimizer, _DistributedOptimizer, named_parameters, compression,
                   backward_passes_per_step, op, gradient_predivide_factor, groups,
                   sparse_as_dense, process_set, overlap_update)
    # Rank 0 says what this optimizer runs with (runtime/startup_line.py).
    _startup_line.announce_optimizer(wrapped, compression, _overlap.requested(overlap_update))
    return wrapped


def _sharded(optimizer: torch.optim.Optimizer, named_parameters: Optional[NamedParameters],
             compression: Any, backward_passes_per_step: int, op: int,
             gradient_predivide_factor: float, groups: Optional[Groups], sparse_as_dense: bool,
             process_set: ProcessSet, overlap_update: Optional[bool]) -> torch.optim.Optimizer:
    """``shard_optimizer_state=True``: the sharded strategy, after refusing what it does not
    combine with."""
    unsupported = [what for what, used in (
        ("compression", compression is not Compression.none),
        ("groups", groups is not None), ("sparse_as_dense", sparse_as_dense),
        ("overlap_update", bool(overlap_update)), ("op=Adasum", op == Adasum)) if used]
    if unsupported:
        raise ValueError("shard_optimizer_state=True cannot be combined with "
                         + ", ".join(unsupported) + ".")
    from aiak_training.torch.sharded import ShardedStrategy
    wrapped = wrap(optimizer, ShardedStrategy, named_parameters, backward_passes_per_step, op,
                   gradient_predivide_factor, process_set)
    _startup_line.announce_optimizer(wrapped, compression, False)
    return wrapped
