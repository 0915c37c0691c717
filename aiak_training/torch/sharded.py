"""``DistributedOptimizer(..., shard_optimizer_state=True)``: the sharded reduction strategy.

Each rank keeps the optimizer state of 1/N of the parameters only (ZeRO stage 1, with
gradients reduce-scattered as in stage 2):

* the trainable parameters are cut into buckets (per param group, dtype and device kind, in
  name order, up to ``AIAK_SHARD_BUCKET_BYTES``, default 16 MiB).  A bucket is the flat
  concatenation of its parameters, padded to a multiple of N; rank r owns its r-th contiguous
  slice (the *shard*), so every rank holds the same number of bytes, to N - 1 elements;
* when every gradient of a bucket is ready in backward (after ``backward_passes_per_step``
  passes), they are copied into one flat buffer, the full gradients are freed
  (``p.grad = None``) and the buffer is reduce-scattered by the engine (``op`` Average or Sum,
  with ``gradient_predivide_factor``): each rank receives the reduced gradient of its shard;
* ``step()`` runs the wrapped optimizer on the shard only: each param group's ``params`` is
  replaced, for the call, by *pieces*, views of this rank's shard buffer, one per parameter
  (part) it holds, with views of the reduced shard gradient as ``.grad``.  The optimizer's
  state is keyed by the pieces, so it exists for the shard only;
* each bucket's updated shard is then allgathered and copied back into the parameters.

Only optimizers that update every element from that element's gradient and state are
accepted (the ``torch.optim`` classes listed in ``overlap.py`` and FusedSGD/FusedAdam/
FusedAdamW); a step on pieces is then the same arithmetic as on whole parameters.

Checkpoints: ``state_dict()`` never communicates.  It returns the full state gathered by the
last ``consolidate_state_dict()`` (a collective: every rank calls it) and raises otherwise,
so that ``if hvd.rank() == 0: torch.save(opt.state_dict())`` can fail but never hang.
``load_state_dict`` takes a full (plain-optimizer format) state dict from any world size and
keeps this rank's slices.
"""
from __future__ import annotations

import collections
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from aiak_training.common import horovod_strings as hs
from aiak_training.common.env import env_bytes
from aiak_training.runtime.process_sets import ProcessSet, global_process_set
from aiak_training.torch import overlap as _overlap
from aiak_training.torch.mpi_ops import (Average, Sum, allgather_async, rank,
                                         reducescatter_async, size, synchronize)
from aiak_training.torch.wrapper import DistributedWrapper, NamedParameters

BUCKET_ENV_VAR = "AIAK_SHARD_BUCKET_BYTES"
DEFAULT_BUCKET_BYTES = 16 << 20

CONSOLIDATE_FIRST = (
    "state_dict() of an optimizer with shard_optimizer_state=True: each rank holds only its "
    "shard of the state. Call optimizer.consolidate_state_dict() on every rank first (a "
    "collective), then state_dict() on any rank, e.g. before "
    "`if hvd.rank() == 0: torch.save(...)`. The consolidated copy is dropped by the next step().")


def _elementwise_classes() -> Tuple[type, ...]:
    """Optimizer classes whose step updates each element from its own gradient and state."""
    from aiak_training.fused_optim import FusedAdam, FusedAdamW, FusedSGD
    return _overlap._torch_safe_classes() + (FusedSGD, FusedAdam, FusedAdamW)


def _per_element(key: str, value: Any, p: torch.Tensor) -> bool:
    """Whether state entry ``key`` holds one value per element of ``p`` (sliced with it)."""
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == p.shape


class _Bucket:
    """Consecutive parameters reduced together, and this rank's shard of them."""

    def __init__(self, index: int, group: int, params: List[torch.Tensor], name: str,
                 nranks: int, me: int):
        self.group = group
        self.params = params
        self.name = f"sharded.{index}.{name}"
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.shard = max(1, -(-total // nranks))
        self.padded = self.shard * nranks
        lo = me * self.shard
        first = params[0]
        self.weights = torch.zeros(self.shard, dtype=first.dtype, device=first.device)
        self.grad = torch.zeros_like(self.weights)
        self.ready = 0
        # Parameters whose gradient was missing when the bucket was last reduced.
        self.missing: set = set()
        # (parameter, start, stop within the flattened parameter, piece of self.weights)
        self.pieces: List[Tuple[torch.Tensor, int, int, torch.Tensor]] = []
        for p, off in zip(params, self.offsets):
            a, b = max(lo, off), min(lo + self.shard, off + p.numel())
            if a < b:
                piece = self.weights[a - lo:b - lo]
                piece.grad = self.grad[a - lo:b - lo]
                self.pieces.append((p, a - off, b - off, piece))

    def load_pieces(self) -> None:
        """Copy the parameters' current values into the shard (the user may have changed
        them: broadcast_parameters, a loaded checkpoint)."""
        with torch.no_grad():
            for p, a, b, piece in self.pieces:
                piece.copy_(p.detach().reshape(-1)[a:b])

    def flat_gradient(self) -> torch.Tensor:
        """The bucket's gradients in one padded buffer (zeros where a gradient is missing)."""
        flat = torch.zeros(self.padded, dtype=self.weights.dtype, device=self.weights.device)
        for p, off in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
        return flat

    def scatter_back(self, full: torch.Tensor) -> None:
        """Write the allgathered bucket ``full`` into the parameters."""
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                p.copy_(full[off:off + p.numel()].view_as(p))


class ShardedStrategy(DistributedWrapper):
    """The sharded strategy of the distributed-optimizer wrapper (module docstring)."""

    _aiak_sharded = True

    def __init__(self, params: Any, named_parameters: Optional[NamedParameters],
                 backward_passes_per_step: int, op: int, gradient_predivide_factor: float,
                 process_set: ProcessSet = global_process_set):
        super().__init__(params, named_parameters, backward_passes_per_step, op, process_set)
        base = type(self)._aiak_wrapped_class
        # The exact classes: a subclass may change step().
        if base not in _elementwise_classes():
            raise ValueError(
                f"shard_optimizer_state=True: {base.__name__} is not an optimizer known to "
                "update each element independently, so stepping it on a shard of the "
                "parameters could change its result. Supported: torch.optim SGD, Adam, AdamW "
                "(and the other elementwise torch.optim classes), FusedSGD, FusedAdam, "
                "FusedAdamW.")
        if op not in (Average, Sum):
            raise ValueError("shard_optimizer_state=True supports op=Average and op=Sum only.")
        if process_set.process_set_id != global_process_set.process_set_id:
            raise NotImplementedError("shard_optimizer_state=True shards over all ranks: "
                                      "process_set must be the global process set.")
        self.gradient_predivide_factor = gradient_predivide_factor
        self._consolidated: Optional[Dict[str, Any]] = None
        self._buckets = self._make_buckets(env_bytes(BUCKET_ENV_VAR, DEFAULT_BUCKET_BYTES, 1))
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        for p in self._bucket_of:
            self._requires_update.add(p)
            self._grad_accs.append(self._attach_hook(p))

    def _make_buckets(self, limit: int) -> List[_Bucket]:
        buckets: List[_Bucket] = []
        name_of = self._parameter_names.get
        for gi, group in enumerate(self.param_groups):
            kinds: Dict[Tuple[str, str], List[torch.Tensor]] = {}
            for p in sorted((p for p in group["params"] if p.requires_grad), key=name_of):
                if p.is_sparse:
                    raise ValueError(f"shard_optimizer_state=True: parameter {name_of(p)} is a "
                                     "sparse tensor; sharding needs dense parameters.")
                kinds.setdefault((str(p.dtype), p.device.type), []).append(p)
            for key in sorted(kinds):
                run: List[torch.Tensor] = []
                nbytes = 0
                for p in kinds[key] + [None]:
                    if run and (p is None or nbytes + p.numel() * p.element_size() > limit):
                        buckets.append(_Bucket(len(buckets), gi, run, name_of(run[0]),
                                               size(), rank()))
                        run, nbytes = [], 0
                    if p is not None:
                        run.append(p)
                        nbytes += p.numel() * p.element_size()
        return buckets

    # ---- backward: reduce-scatter each bucket once all its gradients are in -----------------
    def _gradient_ready(self, p: torch.Tensor) -> None:
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(hs.TOO_MANY_BACKWARD_PASSES)
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(f"shard_optimizer_state=True: the gradient of "
                             f"{self._parameter_names.get(p)} is sparse (e.g. "
                             "Embedding(sparse=True)); sharding needs dense gradients.")
        self._allreduce_delay[p] -= 1
        bucket = self._bucket_of[p]
        self._handles.setdefault(bucket, (None, None))
        if self._allreduce_delay[p] == 0:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        flat = bucket.flat_gradient()
        bucket.missing = {p for p in bucket.params if p.grad is None}
        for p in bucket.params:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"shard_optimizer_state=True: the gradient of "
                                 f"{self._parameter_names.get(p)} is sparse.")
            p.grad = None  # reduced from here on: the full gradient is not kept
        pre, post = self._scale_factors()
        handle = reducescatter_async(flat, name=bucket.name, op=self.op, prescale_factor=pre,
                                     postscale_factor=post, process_set=self.process_set)
        self._handles[bucket] = (handle, None)
        bucket.ready = 0

    def synchronize(self) -> None:
        """Finish every bucket's reduce-scatter (starting those backward did not), leaving
        this rank's shard of the reduced gradient for ``step()``.  The model's ``p.grad`` are
        None afterwards: use :meth:`clip_grad_norm_` to clip."""
        for bucket in self._buckets:  # the same order on every rank
            handle, _ = self._handles.get(bucket, (None, None))
            if handle is None:
                self._start(bucket)
        for bucket in self._buckets:
            handle, _ = self._handles.pop(bucket)
            bucket.grad.copy_(synchronize(handle))
            for p in bucket.params:
                self._rearm(p)
        self._handles.clear()
        self._synchronized = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients (call after :meth:`synchronize`, then step inside
        :meth:`skip_synchronize`) by their global norm over all shards, as
        ``torch.nn.utils.clip_grad_norm_`` would on the full averaged gradients.  A collective;
        returns the total norm."""
        from aiak_training.torch.mpi_ops import allreduce
        if norm_type != 2.0:
            raise ValueError("clip_grad_norm_ of a sharded optimizer supports norm_type=2 only.")
        local = torch.zeros((), dtype=torch.float64)
        for b in self._buckets:
            local += b.grad.double().pow(2).sum().cpu()  # padding is zero
        total = allreduce(local, op=Sum, name="sharded.clip_grad_norm").sqrt()
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for b in self._buckets:
                b.grad.mul_(coef)
        return total.to(torch.float32)

    # ---- the step on the shard, then the allgather -------------------------------------------
    @contextmanager
    def _on_shard(self) -> Iterator[None]:
        """Each param group lists this rank's pieces instead of the model's parameters."""
        lists: List[List[torch.Tensor]] = [[] for _ in self.param_groups]
        # On one rank the dense DistributedOptimizer is the plain optimizer, which skips a
        # parameter without gradient; on several, the missing gradient is reduced as zeros
        # (another rank may have one) and the parameter is stepped.
        alone = size() == 1
        for b in self._buckets:
            lists[b.group].extend(piece for p, _, _, piece in b.pieces
                                  if not (alone and p in b.missing))
        saved = [g["params"] for g in self.param_groups]
        try:
            for g, pieces in zip(self.param_groups, lists):
                g["params"] = pieces
            yield
        finally:
            for g, params in zip(self.param_groups, saved):
                g["params"] = params

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._synchronize_for_step()
        for b in self._buckets:
            b.load_pieces()
        with self._on_shard():
            self._wrapped_step()
        handles = [allgather_async(b.weights, name=f"{b.name}.gather",
                                   process_set=self.process_set) for b in self._buckets]
        for b, h in zip(self._buckets, handles):
            b.scatter_back(synchronize(h))
        self._consolidated = None
        return loss

    # ---- state: carried over, loaded, consolidated -------------------------------------------
    def _shard_state(self) -> None:
        """Replace each full-parameter state entry by one entry per piece of this shard."""
        for b in self._buckets:
            for p, a, c, piece in b.pieces:
                full = self.state.get(p)
                if full:
                    self.state[piece] = {
                        k: (v.reshape(-1)[a:c].clone() if _per_element(k, v, p)
                            else v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in full.items()}
        for p in self._bucket_of:
            self.state.pop(p, None)

    def _carry_state(self, state: Dict[torch.Tensor, Dict[str, Any]]) -> None:
        super()._carry_state(state)
        self._shard_state()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full state dict (``consolidate_state_dict()``'s or a plain optimizer's, of
        any world size) and keep this rank's slices of it."""
        super().load_state_dict(state_dict)
        self._shard_state()
        self._consolidated = None

    def state_dict(self) -> Dict[str, Any]:
        """The full state gathered by the last :meth:`consolidate_state_dict`; never
        communicates, raises ``RuntimeError`` when there is none since the last step."""
        if self._consolidated is None:
            raise RuntimeError(CONSOLIDATE_FIRST)
        return self._consolidated

    def consolidate_state_dict(self) -> Dict[str, Any]:
        """Gather the full optimizer state, in the plain optimizer's format, on every rank.

        A collective: call it on every rank (then ``state_dict()`` returns the result until the
        next ``step()``).  Memory: the full state is held on every rank while it lives."""
        from aiak_training.torch.functions import allgather_object
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        # Which entries each parameter has, and its non-sliced values, from its owners.
        local: Dict[int, Dict[str, Any]] = {}
        for b in self._buckets:
            for p, _, _, piece in b.pieces:
                entry = self.state.get(piece, {})
                local.setdefault(index[p], {k: ("sliced", v.dtype) if _per_element(k, v, piece)
                                            else ("whole", v) for k, v in entry.items()})
        merged: Dict[int, Dict[str, Any]] = {}
        for part in allgather_object(local, name="sharded.state_keys"):
            for i, entry in part.items():
                merged.setdefault(i, entry)
        state: Dict[int, Dict[str, Any]] = {}
        for b in self._buckets:
            keys = sorted({k for p in b.params for k, (kind, _) in merged.get(index[p], {}).items()
                           if kind == "sliced"})
            for key in keys:
                dtype = next(merged[index[p]][key][1] for p in b.params
                             if key in merged.get(index[p], {}))
                flat = torch.zeros(b.shard, dtype=dtype, device=b.weights.device)
                lo = b.weights.storage_offset()
                for _, _, _, piece in b.pieces:
                    value = self.state.get(piece, {}).get(key)
                    if value is not None:
                        start = piece.storage_offset() - lo
                        flat[start:start + piece.numel()].copy_(value)
                full = synchronize(allgather_async(flat, name=f"{b.name}.state.{key}",
                                                   process_set=self.process_set))
                for p, off in zip(b.params, b.offsets):
                    if key in merged.get(index[p], {}):
                        state.setdefault(index[p], {})[key] = \
                            full[off:off + p.numel()].view_as(p).clone()
        for i, entry in merged.items():
            for k, (kind, value) in entry.items():
                if kind == "whole":
                    state.setdefault(i, {})[k] = value
        # State of parameters outside the shards (frozen ones) is kept whole on every rank.
        for p, entry in self.state.items():
            if p in index and entry:
                state[index[p]] = dict(entry)
        live = self.state
        self.state = collections.defaultdict(dict)
        try:
            sd = super(DistributedWrapper, self).state_dict()  # the param_groups part
        finally:
            self.state = live
        sd["state"] = dict(sorted(state.items()))
        self._consolidated = sd
        return sd

    def broadcast_options(self, root_rank: int) -> None:
        """``hvd.broadcast_optimizer_state`` for a sharded optimizer: every shard's state
        exists once, so only the param groups' options (``lr``...) are made equal to
        ``root_rank``'s."""
        from aiak_training.torch.functions import broadcast_object
        options = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        for g, opts in zip(self.param_groups,
                           broadcast_object(options, root_rank, name="sharded.options")):
            g.update(opts)
