"""``hvd.DistributedOptimizer``: the distributed optimizers of the torch frontend.

One wrapper (``wrapper.py``) turns the user's optimizer into a distributed one; what a
gradient's reduction is, is the *strategy* :func:`DistributedOptimizer` picks:

* ``allreduce.py``: Horovod's allreduce of each gradient from its backward hook (the
  default), with the overlapped update of ``overlap.py`` (``overlap_update=True``);
* ``adasum.py``: ``op=Adasum`` on more than one rank, which Adasum-combines the updates;
* ``sharded/``: ``shard_optimizer_state=True``, ZeRO-style sharded optimizer state;
* DGC: ``compression=hvd.Compression.dgc(...)``.  Its strategy lives in
  ``aiak_training.dgc`` (``dgc/optimizer.py``), a layer above this one that this package
  does not import: the dispatch recognises its options and lets them build it.
"""
import os
import sys
import warnings
from typing import Any, Optional

import torch

from aiak_training.common import horovod_strings as hs
from aiak_training.common.tuning import FUSED_OPTIMIZER
from aiak_training.runtime.diagnostics import startup_line as _startup_line
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.torch.compression import Compression
from aiak_training.torch.mpi_ops import Adasum, Average, size
from aiak_training.torch.optim import overlap as _overlap
from aiak_training.torch.optim.allreduce import Groups, _DistributedOptimizer
from aiak_training.torch.optim.wrapper import NamedParameters, wrap

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
            Adasum-combined (see ``optim/adasum.py``; a power-of-two number of ranks).
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
            shard, and the updated parameters are allgathered (``optim/sharded/``,
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
        # delta optimizer (adasum.py).
        if process_set.process_set_id != global_process_set.process_set_id:
            raise NotImplementedError(hs.ADASUM_PROCESS_SETS)
        from aiak_training.torch.optim.adasum import AdasumDeltaStrategy
        return wrap(optimizer, AdasumDeltaStrategy, named_parameters, compression,
                    backward_passes_per_step)

    if _is_dgc(compression):
        return _dgc(optimizer, named_parameters, compression, backward_passes_per_step, op,
                    gradient_predivide_factor, groups, sparse_as_dense, process_set,
                    overlap_update)

    if os.environ.get(FUSED_OPTIMIZER.variable, "") not in ("", "0"):
        from aiak_training.fused_optim import maybe_fuse
        optimizer = maybe_fuse(optimizer)

    wrapped = wrap(optimizer, _DistributedOptimizer, named_parameters, compression,
                   backward_passes_per_step, op, gradient_predivide_factor, groups,
                   sparse_as_dense, process_set, overlap_update)
    # Rank 0 says what this optimizer runs with (runtime/diagnostics/startup_line.py).
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
    from aiak_training.torch.optim.sharded import ShardedStrategy
    wrapped = wrap(optimizer, ShardedStrategy, named_parameters, backward_passes_per_step, op,
                   gradient_predivide_factor, process_set)
    _startup_line.announce_optimizer(wrapped, compression, False)
    return wrapped


def _is_dgc(compression: Any) -> bool:
    """Whether ``compression`` is ``hvd.Compression.dgc`` (``aiak_training.dgc``'s
    ``DGCCompressor``, the ``dgc`` compressor plugin) or one of its instances.

    DGC's package imports this one, not the other way round, so it is looked up among the
    imported modules: it can only have been given if its package is imported already."""
    dgc = sys.modules.get("aiak_training.dgc")
    if dgc is None:
        return False
    options = dgc.DGCCompressor
    return compression is options or isinstance(compression, options)


def _dgc(optimizer: torch.optim.Optimizer, named_parameters: Optional[NamedParameters],
         compression: Any, backward_passes_per_step: int, op: int,
         gradient_predivide_factor: float, groups: Optional[Groups], sparse_as_dense: bool,
         process_set: ProcessSet, overlap_update: Optional[bool]) -> torch.optim.Optimizer:
    """``compression=hvd.Compression.dgc(...)``: the DGC strategy (``dgc/optimizer.py``),
    which its options object builds, after saying what it ignores."""
    if overlap_update and not _overlap.requested(None):
        # With AIAK_OVERLAP_UPDATE set, the base __init__ logs this itself.
        _overlap.log_fallback_once(set(), "dgc")
    if groups is not None or sparse_as_dense:
        warnings.warn("Compression.dgc exchanges each gradient on its own as sparse "
                      "(index, value) pairs: groups= and sparse_as_dense= have no effect.",
                      UserWarning, stacklevel=3)
    made = compression.make_distributed_optimizer(
        optimizer, named_parameters=named_parameters,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor, process_set=process_set)
    _startup_line.announce_optimizer(made, compression, False)  # DGC steps synchronously
    return made
