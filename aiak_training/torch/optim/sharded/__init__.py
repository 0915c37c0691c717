"""``DistributedOptimizer(..., shard_optimizer_state=True)``: the sharded reduction strategy.

Each rank keeps the optimizer state of 1/N of the parameters only (ZeRO stage 1, with
gradients reduce-scattered as in stage 2):

* the trainable parameters are cut into buckets (per param group, dtype and device kind, in
  name order, up to ``AIAK_SHARD_BUCKET_BYTES``, default 16 MiB).  A bucket is the packed
  concatenation of its parameters, padded to a multiple of N; rank r owns its r-th contiguous
  slice (the *shard*), so every rank holds the same number of bytes, to N - 1 elements;
* when every gradient of a bucket is ready in backward (after ``backward_passes_per_step``
  passes), the bucket is reduce-scattered by the engine (``op`` Average or Sum, with
  ``gradient_predivide_factor``) straight into the shard's gradient buffer.  With bounded
  gradients (``AIAK_SHARD_GRADIENTS``, the default) each gradient is added into its
  bucket's packed buffer as soon as autograd has accumulated it, and freed (``p.grad =
  None``); at most ``REDUCES_IN_FLIGHT`` reduce-scatters run at once, so packed buffers exist
  only for those and for the buckets being filled, and they are reused (memory: a few
  buckets).  With kept gradients each bucket owns a gradient buffer, every ``p.grad`` is a
  view of it, and it is reduce-scattered from there (no copy where autograd accumulated
  into the view; the gradients' memory is kept, as dense);
* ``step()`` runs the wrapped optimizer on the shard only: each param group's ``params`` is
  replaced, for the call, by *pieces*, views of this rank's shard buffer, one per parameter
  (part) it holds, with views of the reduced shard gradient as ``.grad``.  The optimizer's
  state is keyed by the pieces, so it exists for the shard only;
* each bucket's updated shard is then allgathered straight into the parameters: a bucket
  owns its parameters' storage (one packed buffer, each ``p.data`` a view of it), so the
  allgather needs no buffer and nothing is copied back.  Collectives write into memory the
  strategy owns (their ``out=`` argument): nothing comes from the output pool, so the memory
  the strategy frees is not kept for reuse.

Only optimizers that update every element from that element's gradient and state are
accepted (the ``torch.optim`` classes listed in ``optim/overlap.py`` and FusedSGD/FusedAdam/
FusedAdamW); a step on pieces is then the same arithmetic as on whole parameters. FusedLAMB
also needs whole-tensor norms (the global gradient norm, each parameter's trust ratio): its
step on pieces is ``step.py``'s :func:`step_on_pieces`, which sums the pieces' partial sums
of squares over the ranks in one small allreduce.

With :meth:`ShardedStrategy.overlap_allgather` the allgathers started by ``step()`` are waited
for by forward pre-hooks of the modules owning the parameters, so they overlap the next
forward pass; everything else that reads or writes the parameters waits first.

Checkpoints: ``state_dict()`` never communicates.  It returns the full state gathered by the
last ``consolidate_state_dict()`` (a collective: every rank calls it) and raises otherwise,
so that ``if hvd.rank() == 0: torch.save(opt.state_dict())`` can fail but never hang.
``load_state_dict`` takes a full (plain-optimizer format) state dict from any world size and
keeps this rank's slices.

The package follows these concepts: ``buckets.py`` (buckets and packed storage), ``reduce.py``
(the backward reduce-scatter), ``step.py`` (the step on the shard, FusedLAMB's included),
``gather.py`` (the allgather overlapped with forward) and ``checkpoint.py``; each but the
first is one part of :class:`ShardedStrategy`, which holds the fields they share.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from aiak_training.common.env import env_bytes
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.torch.mpi_ops import Average, Sum
from aiak_training.torch.optim import overlap as _overlap
from aiak_training.torch.optim.sharded.buckets import (BUCKET_ENV_VAR, DEFAULT_BUCKET_BYTES,
                                                       GRADIENT_MODES, GRADIENTS_ENV_VAR,
                                                       Bucket, BufferCache, gradient_mode,
                                                       make_buckets)
from aiak_training.torch.optim.sharded.checkpoint import Checkpoints
from aiak_training.torch.optim.sharded.gather import GatherOverlap, wait_for_all_parameters
from aiak_training.torch.optim.sharded.reduce import REDUCES_IN_FLIGHT, ReduceScatter
from aiak_training.torch.optim.sharded.step import ShardStep
from aiak_training.torch.optim.wrapper import DistributedWrapper, NamedParameters

__all__ = ["ShardedStrategy", "wait_for_all_parameters", "BUCKET_ENV_VAR", "GRADIENTS_ENV_VAR",
           "GRADIENT_MODES", "REDUCES_IN_FLIGHT"]


def _elementwise_classes() -> Tuple[type, ...]:
    """Optimizer classes whose step updates each element from its own gradient and state."""
    from aiak_training.fused_optim import FusedAdam, FusedAdamW, FusedSGD
    return _overlap._torch_safe_classes() + (FusedSGD, FusedAdam, FusedAdamW)


def _norm_hooked_classes() -> Tuple[type, ...]:
    """Optimizer classes that need whole-tensor norms, stepped by ``step.py``."""
    from aiak_training.fused_optim import FusedLAMB
    return (FusedLAMB,)


class ShardedStrategy(GatherOverlap, Checkpoints, ShardStep, ReduceScatter, DistributedWrapper):
    """The sharded strategy of the distributed-optimizer wrapper (module docstring): its
    fields, and its parts from the modules of this package."""

    _aiak_sharded = True

    def __init__(self, params: Any, named_parameters: Optional[NamedParameters],
                 backward_passes_per_step: int, op: int, gradient_predivide_factor: float,
                 process_set: ProcessSet = global_process_set):
        super().__init__(params, named_parameters, backward_passes_per_step, op, process_set)
        base = type(self)._aiak_wrapped_class
        # The exact classes: a subclass may change step().
        if base not in _elementwise_classes() + _norm_hooked_classes():
            raise ValueError(
                f"shard_optimizer_state=True: {base.__name__} is not an optimizer known to "
                "update each element independently, so stepping it on a shard of the "
                "parameters could change its result. Supported: torch.optim SGD, Adam, AdamW "
                "(and the other elementwise torch.optim classes), FusedSGD, FusedAdam, "
                "FusedAdamW, FusedLAMB.")
        if op not in (Average, Sum):
            raise ValueError("shard_optimizer_state=True supports op=Average and op=Sum only.")
        if process_set.process_set_id != global_process_set.process_set_id:
            raise NotImplementedError("shard_optimizer_state=True shards over all ranks: "
                                      "process_set must be the global process set.")
        self.gradient_predivide_factor = gradient_predivide_factor
        self._consolidated: Optional[Dict[str, Any]] = None
        self._kept_grads = gradient_mode() == "kept"
        self._buckets = make_buckets(self.param_groups, self._parameter_names.get,
                                     env_bytes(BUCKET_ENV_VAR, DEFAULT_BUCKET_BYTES, 1),
                                     self._kept_grads)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        for p in self._bucket_of:
            self._requires_update.add(p)
            self._grad_accs.append(self._attach_hook(p))
        # FusedLAMB: each piece's row in the table of per-parameter norms (step.py).
        self._lamb_rows: Optional[Dict[torch.Tensor, int]] = None
        if base in _norm_hooked_classes():
            row = {p: i for i, p in enumerate(self._bucket_of)}  # bucket order, on every rank
            self._lamb_rows = {piece: row[p] for b in self._buckets for p, _, _, piece in b.pieces}
        # Allgathers started by step() and not yet waited for (their handles, in the order
        # they were started, _gather_order), and the module hooks that wait for them
        # (overlap_allgather).
        self._gathers: Dict[Bucket, Any] = {}
        self._gather_order: List[Bucket] = list(self._buckets)
        self._model_hooks: List[Any] = []
        # Reduce-scatter inputs, reused from step to step (buckets.py): enough for the
        # reduce-scatters in flight plus the one starting.
        self._buffers = BufferCache(REDUCES_IN_FLIGHT + 1)
        # Every buffer is as large as the largest bucket of its dtype and device, so that
        # any of them serves any bucket.
        self._buffer_numel: Dict[Tuple[torch.dtype, torch.device], int] = {}
        for b in self._buckets:
            kind = (b.storage.dtype, b.storage.device)
            self._buffer_numel[kind] = max(self._buffer_numel.get(kind, 0), b.padded)
        self._bound_reduces = True  # False after a wait for the oldest one timed out
