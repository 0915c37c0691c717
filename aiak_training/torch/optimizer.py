"""DistributedOptimizer: averages gradients across ranks as they are produced.

Hooks fire as each gradient is accumulated and start an asynchronous in-place allreduce;
``step()`` waits for them (``synchronize()``) and then runs the wrapped optimizer.  With
``overlap_update`` on, ``step()`` instead updates each bucket of parameters as soon as its
reduction completes, while the others are still being reduced (see ``overlap.py``).
"""
import os
import warnings
from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional

import torch

from aiak_training.runtime.process_sets import ProcessSet, global_process_set
from aiak_training.torch import overlap as _overlap
from aiak_training.torch.compression import Compression
from aiak_training.torch.mpi_ops import (Adasum, Average, allreduce_async_,
                                         grouped_allreduce_async_, size,
                                         sparse_allreduce_async, synchronize)


def _split_list(items: List, n: int) -> List[List]:
    """Split ``items`` into ``n`` contiguous parts whose lengths differ by at most one."""
    k, m = divmod(len(items), n)
    return [items[i * k + min(i, m):(i + 1) * k + min(i + 1, m)] for i in range(n)]


class _DistributedOptimizer(torch.optim.Optimizer):
    _aiak_distributed = True

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, groups=None,
                 sparse_as_dense=False, process_set=global_process_set,
                 overlap_update: Optional[bool] = None):
        super(self.__class__, self).__init__(params)
        self._compression = compression

        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, param_group in enumerate(self.param_groups)
                                for j, v in enumerate(param_group["params"])]
        # make sure that named_parameters are tuples
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")

        dups = _DistributedOptimizer.find_duplicates([k for k, _ in named_parameters])
        if len(dups) > 0:
            raise ValueError("Parameter names in named_parameters must be unique. "
                             "Found duplicates: %s" % ", ".join(dups))

        all_param_ids = {id(v) for param_group in self.param_groups
                         for v in param_group["params"]}
        named_param_ids = {id(v) for k, v in named_parameters}
        unnamed_param_ids = all_param_ids - named_param_ids
        if len(unnamed_param_ids):
            raise ValueError("named_parameters was specified, but one or more model "
                             "parameters were not named. Python object ids: "
                             "%s" % ", ".join(str(id) for id in unnamed_param_ids))

        self._parameter_names = {v: k for k, v in sorted(named_parameters)}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: self.backward_passes_per_step
                                 for _, v in sorted(named_parameters)}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        self._handles: Dict = {}
        self._grad_accs: List = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True

        if groups is not None:
            if not (isinstance(groups, list) or groups > 0):
                raise ValueError("groups should be a non-negative integer or a list of list of "
                                 "torch.Tensor.")
            if isinstance(groups, list):
                grouped_parameter_ids = set()
                for l in groups:
                    for p in l:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in grouped_parameter_ids:
                            raise ValueError("A parameter can only appear once in groups.")
                        grouped_parameter_ids.add(id(p))
        self._groups = groups
        self._p_to_group: Dict = {}
        self._group_counts: Dict = {}

        if self.process_set.included() and (size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._register_hooks()

        # Overlapped update (None: off).  Decided once here; each step may still fall back.
        self._overlap: Optional[_overlap.Overlap] = None
        if _overlap.requested(overlap_update):
            reason, check = _overlap.Overlap.static_reason(self)
            if reason is None:
                self._overlap = _overlap.Overlap(check)
            else:
                _overlap.log_fallback_once(set(), reason)

    def overlap_stats(self) -> dict:
        """Counters of the overlapped update (``overlap_update``): steps overlapped and fallen
        back (by reason), buckets, parameter updates, and the update time hidden behind
        communication.  Empty when overlap is off."""
        return {} if self._overlap is None else self._overlap.stats.as_dict()

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    @staticmethod
    def find_duplicates(lst: Iterable) -> set:
        seen = set()
        dups = set()
        for el in lst:
            if el in seen:
                dups.add(el)
            seen.add(el)
        return dups

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def _register_hooks(self) -> None:
        if self._groups is not None:
            p_list = []
            # Get list of parameters with grads
            for param_group in self.param_groups:
                for p in param_group["params"]:
                    if p.requires_grad:
                        p_list.append(p)

            # To ensure parameter order and group formation is consistent, sort by name
            p_list = sorted(p_list, key=lambda p: self._parameter_names.get(p))

            if isinstance(self._groups, int):
                p_groups = _split_list(p_list, self._groups)
            else:
                # As Horovod: a listed tensor that is not a parameter with a gradient (frozen,
                # or not in this optimizer) is left out of its group.
                with_grad = {id(p) for p in p_list}
                p_groups = [sorted((p for p in g if id(p) in with_grad),
                                   key=lambda p: self._parameter_names.get(p))
                            for g in self._groups]
                listed = {id(p) for group in p_groups for p in group}
                p_groups += [[p] for p in p_list if id(p) not in listed]
            p_groups = [tuple(g) for g in p_groups if g]
            for group in p_groups:
                for p in group:
                    self._p_to_group[p] = group
                self._group_counts[group] = 0

        for param_group in self.param_groups:
            for p in param_group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    if hasattr(p, "register_post_accumulate_grad_hook"):
                        self._grad_accs.append(
                            p.register_post_accumulate_grad_hook(self._make_hook(p)))
                    else:  # torch < 2.1
                        p_tmp = p.expand_as(p)
                        grad_acc = p_tmp.grad_fn.next_functions[0][0]
                        grad_acc.register_hook(lambda *_, hook=self._make_hook(p), p=p: hook(p))
                        self._grad_accs.append(grad_acc)

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # Gradient was not computed, but we still need to submit a tensor to allreduce
            # as one of the other ranks may have computed it (due to dynamic forward functions).
            #
            # NOTE: this will not work if the gradient is sparse and we perform an allgather.
            # Unfrotunately, there doesn't appear to be a good way to detect that the parameter
            # will produce sparse gradients before computing the gradient.
            p.grad = p.data.new(p.size()).zero_()

        name = self._parameter_names.get(p)
        tensor = p.grad

        if p.grad.is_sparse:
            if self.sparse_as_dense:
                tensor = tensor.to_dense()
            else:
                return self._sparse_allreduce_grad_async(p, name)

        tensor_compressed, ctx = self._compression.compress(tensor)

        if self.op == Average:
            # Split average operation across pre/postscale factors
            # C++ backend will apply additional 1 / size() factor to postscale_factor for
            # op == Average.
            prescale_factor = 1.0 / self.gradient_predivide_factor
            postscale_factor = self.gradient_predivide_factor
        else:
            prescale_factor = 1.0
            postscale_factor = 1.0

        handle = allreduce_async_(tensor_compressed, name=name, op=self.op,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor,
                                  process_set=self.process_set)
        return handle, ctx

    def _grouped_allreduce_grad_async(self, ps):
        name = self._parameter_names.get(ps[0])
        tensors_compressed, ctxs = zip(*[self._compression.compress(p.grad) for p in ps])
        handle = grouped_allreduce_async_(list(tensors_compressed), name=name, op=self.op,
                                          process_set=self.process_set)
        return handle, ctxs

    def _sparse_allreduce_grad_async(self, p, name):
        handle = sparse_allreduce_async(p.grad, name=name, op=self.op,
                                        process_set=self.process_set)
        return handle, None

    def _make_hook(self, p):
        def hook(*ignore):
            if p in self._handles and self._handles[p][0] is not None:
                if self._allreduce_delay[p] <= 0:
                    raise AssertionError(
                        "Gradients were computed more than "
                        "backward_passes_per_step times before call "
                        "to step(). Increase backward_passes_per_step to "
                        "accumulate gradients locally.")
            assert not p.grad.requires_grad
            assert self._allreduce_delay[p] > 0
            handle, ctx = None, None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                if self._groups is not None:
                    group = self._p_to_group[p]
                    self._group_counts[group] += 1
                    if self._group_counts[group] == len(group):
                        handle, ctxs = self._grouped_allreduce_grad_async(group)
                        self._handles[group] = (handle, ctxs)
                        # Remove any None entries from previous no-op hook calls
                        for gp in group:
                            self._handles.pop(gp, None)
                        self._group_counts[group] = 0
                        return
                else:
                    handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)
        return hook

    def _submit_pending(self) -> None:
        """Start every allreduce the hooks did not: parameters whose gradient was not produced
        (reduced as zeros, since other ranks may have produced theirs), incomplete groups, and
        passes that ended before ``backward_passes_per_step`` was reached."""
        completed = set()
        for x in self._handles.keys():
            completed.update(x) if isinstance(x, tuple) else completed.add(x)
        missing_p = self._requires_update - completed
        for p in sorted(missing_p, key=lambda q: self._parameter_names.get(q)):
            if self._groups is not None and p in self._p_to_group:
                continue
            handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)
        if self._groups is not None:
            # Groups that did not complete (some grads missing): reduce them now, as a group.
            for group, count in self._group_counts.items():
                if group in self._handles:
                    continue
                if any(p in missing_p for p in group) or count:
                    for gp in group:
                        if gp.grad is None:
                            gp.grad = gp.data.new(gp.size()).zero_()
                        self._handles.pop(gp, None)
                    handle, ctxs = self._grouped_allreduce_grad_async(group)
                    self._handles[group] = (handle, ctxs)
                    self._group_counts[group] = 0

        for p, (handle, ctx) in self._handles.items():
            if handle is None:
                handle, ctx = self._allreduce_grad_async(p)
                self._handles[p] = (handle, ctx)

    def _finish_reduction(self, p, handle, ctx) -> None:
        """Wait for one handle and put the reduced gradient(s) in place (``p`` is a parameter,
        or a tuple of them for a grouped allreduce)."""
        if isinstance(p, tuple):
            # This was a grouped result, need to unpack
            outputs = synchronize(handle)
            for gp, go, gctx in zip(p, outputs, ctx):
                self._allreduce_delay[gp] = self.backward_passes_per_step
                gp.grad.set_(self._compression.decompress(go, gctx))
        else:
            # When handle is a callable function, it returns the aggregated tensor result
            output = synchronize(handle) if not callable(handle) else handle()
            self._allreduce_delay[p] = self.backward_passes_per_step
            if p.grad.is_sparse:
                aggregated = self._compression.decompress(output, ctx)
                if not aggregated.is_sparse:
                    # When sparse_as_dense=True we need to convert the grad back to sparse
                    aggregated = aggregated.to_sparse()
                # Sparse grads do not support set_ for some reason, so we do this as an
                # equivalent operation
                p.grad.zero_().add_(aggregated)
            else:
                p.grad.set_(self._compression.decompress(output, ctx))

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and put the averaged gradients in place.

        Called by ``step()``; call it yourself before modifying gradients (e.g. clipping),
        then run ``step()`` inside ``skip_synchronize()``.
        """
        if not self.process_set.included():
            self._synchronized = True
            return
        self._submit_pending()
        for p, (handle, ctx) in self._handles.items():
            self._finish_reduction(p, handle, ctx)
        self._handles.clear()

        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """
        A context manager used to specify that optimizer.step() should
        not perform synchronization.

        It's typically used in a following pattern:

        .. code-block:: python

            optimizer.synchronize()
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _synchronize_for_step(self) -> None:
        """step()'s synchronize(), unless the script already called it and is inside
        ``skip_synchronize()``."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without "
                              "optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False

    def step(self, closure=None):
        overlap = self._overlap
        if overlap is not None:
            overlap.stats.steps += 1
            if not self.process_set.included() or not self._requires_update:
                pass  # nothing is reduced here (single rank, or not in the set): plain step
            else:
                reason = overlap.step_reason(self, closure)
                if reason is None:
                    self._synchronized = False
                    overlap.step(self, super(self.__class__, self).step)
                    return None
                overlap.fallback(reason)
        self._synchronize_for_step()
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None,
                         compression=Compression.none,
                         backward_passes_per_step=1,
                         op=Average,
                         gradient_predivide_factor=1.0,
                         num_groups=0, groups=None,
                         sparse_as_dense=False,
                         process_set=global_process_set,
                         overlap_update: Optional[bool] = None):
    """
    An optimizer that wraps another torch.optim.Optimizer, using an allreduce to
    combine gradient values before applying gradients to model weights.

    Allreduce operations are executed after each gradient is computed by ``loss.backward()``
    in parallel with each other. The ``step()`` method ensures that all allreduce operations are
    finished before applying gradients to the model.

    DistributedOptimizer exposes the ``synchronize()`` method, which forces allreduce operations
    to finish before continuing the execution. It's useful in conjunction with gradient
    clipping, or other operations that modify gradients in place before ``step()`` is executed.
    Make sure to use ``optimizer.skip_synchronize()`` if you're calling ``synchronize()``
    in your code.

    Example of gradient clipping:

    .. code-block:: python

        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        with optimizer.skip_synchronize():
            optimizer.step()

    Arguments:
        optimizer: Optimizer to use for computing gradients and applying updates.
        named_parameters: A mapping between parameter names and values. Used for naming of
                          allreduce operations. Typically just ``model.named_parameters()``.
        compression: Compression algorithm used during allreduce to reduce the amount
                     of data sent during each parameter update step.  Defaults to
                     not using compression.
        backward_passes_per_step: Number of expected backward passes to perform
                                  before calling step()/synchronize(). This
                                  allows accumulating gradients over multiple
                                  mini-batches before reducing and applying them.
        op: The reduction operation to use when combining gradients across different ranks.
        gradient_predivide_factor: If op == Average, gradient_predivide_factor splits the
                                   averaging before and after the sum. Gradients are scaled by
                                   1.0 / gradient_predivide_factor before the sum and
                                   gradient_predivide_factor / size after the sum.
        num_groups: Number of groups to assign gradient allreduce ops to for explicit
                    grouping. Defaults to no explicit groups.
        groups: The parameter to group the gradient allreduce ops. Accept values is a
                non-negative integer or a list of list of torch.Tensor.
                If groups is a non-negative integer, it is the number of groups to assign
                gradient allreduce ops to for explicit grouping.
                If groups is a list of list of torch.Tensor. Tensors in the same
                inner list will be assigned to the same group, while parameter that does
                not appear in any list will form a group itself.
                Defaults as None, which is no explicit groups.
        sparse_as_dense: If set True, convert all sparse gradients to dense and perform allreduce, then
                         convert back to sparse before applying the update.
        process_set: Gradients will only be reduced over Horovod processes belonging
                     to this process set. Defaults to the global process set.
        overlap_update: If True, ``step()`` updates each bucket of parameters as soon as its
                        allreduce completes, while the remaining buckets are still being
                        reduced, with exactly the same results as the synchronous update.
                        Steps where that cannot be exact (``synchronize()`` called first, e.g.
                        for gradient clipping; a closure; GradScaler; step hooks; sparse
                        gradients; FusedLAMB's global norm) fall back to the synchronous
                        update and log why once.  Defaults to ``AIAK_OVERLAP_UPDATE``
                        (``aiakrun --overlap-update``), else off.  See ``overlap_stats()``.

    Setting ``AIAK_FUSED_OPTIMIZER=1`` swaps a plain ``torch.optim`` Adam, AdamW or SGD for
    the matching ``aiak_training.fused_optim`` class before wrapping it.
    """
    # We dynamically create a new class that inherits from the optimizer that was passed in.
    # The goal is to override the `step()` method with an allreduce implementation.

    if gradient_predivide_factor != 1.0:
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")

    if op == Adasum and size() > 1:
        # On one process Horovod runs the plain optimizer, and so does this.
        raise NotImplementedError("Adasum is not supported by aiak_training yet.")

    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` "
                      "and will be removed in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups

    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")

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
        return factory(optimizer, named_parameters=named_parameters,
                       backward_passes_per_step=backward_passes_per_step, op=op,
                       gradient_predivide_factor=gradient_predivide_factor,
                       process_set=process_set)

    if os.environ.get("AIAK_FUSED_OPTIMIZER", "") not in ("", "0"):
        from aiak_training.fused_optim import maybe_fuse
        optimizer = maybe_fuse(optimizer)

    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, groups,
                  sparse_as_dense, process_set, overlap_update)
    # Keep any state the wrapped optimizer already had (Horovod drops it).
    for p, s in optimizer.state.items():
        wrapped.state[p] = s
    # cls(...) ran the optimizer's __init__ with its default arguments, so ``defaults`` holds
    # those rather than the user's; Apex-style optimizers read options from it at step time
    # (FusedLAMB's max_grad_norm), and add_param_group() fills new groups from it.
    wrapped.defaults.update(optimizer.defaults)
    return wrapped
