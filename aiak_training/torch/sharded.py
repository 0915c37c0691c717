"""``DistributedOptimizer(..., shard_optimizer_state=True)``: the sharded reduction strategy.

Each rank keeps the optimizer state of 1/N of the parameters only (ZeRO stage 1, with
gradients reduce-scattered as in stage 2):

* the trainable parameters are cut into buckets (per param group, dtype and device kind, in
  name order, up to ``AIAK_SHARD_BUCKET_BYTES``, default 16 MiB).  A bucket is the flat
  concatenation of its parameters, padded to a multiple of N; rank r owns its r-th contiguous
  slice (the *shard*), so every rank holds the same number of bytes, to N - 1 elements;
* when every gradient of a bucket is ready in backward (after ``backward_passes_per_step``
  passes), the bucket is reduce-scattered by the engine (``op`` Average or Sum, with
  ``gradient_predivide_factor``) straight into the shard's gradient buffer.  With bounded
  gradients (``AIAK_SHARD_GRADIENTS``, the default) each gradient is added into its
  bucket's flat buffer as soon as autograd has accumulated it, and freed (``p.grad =
  None``); at most ``REDUCES_IN_FLIGHT`` reduce-scatters run at once, so flat buffers exist
  only for those and for the buckets being filled, and they are reused (memory: a few
  buckets).  With flat gradients each bucket owns a gradient buffer, every ``p.grad`` is a
  view of it, and it is reduce-scattered from there (no copy where autograd accumulated
  into the view; the gradients' memory is kept, as dense);
* ``step()`` runs the wrapped optimizer on the shard only: each param group's ``params`` is
  replaced, for the call, by *pieces*, views of this rank's shard buffer, one per parameter
  (part) it holds, with views of the reduced shard gradient as ``.grad``.  The optimizer's
  state is keyed by the pieces, so it exists for the shard only;
* each bucket's updated shard is then allgathered straight into the parameters: a bucket
  owns its parameters' storage (one flat buffer, each ``p.data`` a view of it), so the
  allgather needs no buffer and nothing is copied back.  Collectives write into memory the
  strategy owns (``sharded_io.py``): nothing comes from the output pool, so the memory the
  strategy frees is not kept for reuse.

Only optimizers that update every element from that element's gradient and state are
accepted (the ``torch.optim`` classes listed in ``overlap.py`` and FusedSGD/FusedAdam/
FusedAdamW); a step on pieces is then the same arithmetic as on whole parameters.  FusedLAMB
also needs whole-tensor norms (the global gradient norm, each parameter's trust ratio): its
step on pieces is ``sharded_lamb.py``, which sums the pieces' partial sums of squares over
the ranks in one small allreduce.

With :meth:`ShardedStrategy.overlap_allgather` the allgathers started by ``step()`` are waited
for by forward pre-hooks of the modules owning the parameters, so they overlap the next
forward pass; everything else that reads or writes the parameters waits first.

Checkpoints: ``state_dict()`` never communicates.  It returns the full state gathered by the
last ``consolidate_state_dict()`` (a collective: every rank calls it) and raises otherwise,
so that ``if hvd.rank() == 0: torch.save(opt.state_dict())`` can fail but never hang.
``load_state_dict`` takes a full (plain-optimizer format) state dict from any world size and
keeps this rank's slices.
"""
from __future__ import annotations

import collections
import logging
import time
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from aiak_training.common import horovod_strings as hs
from aiak_training.common.env import env_bytes, env_choice
from aiak_training.runtime.call_origin import collective_helper
from aiak_training.runtime.process_sets import ProcessSet, global_process_set
from aiak_training.torch import overlap as _overlap
from aiak_training.torch.mpi_ops import (Average, Sum, allgather_async, allreduce, poll, rank,
                                         size, synchronize)
from aiak_training.torch.sharded_io import BufferCache, allgather_into, reducescatter_into
from aiak_training.torch.wrapper import DistributedWrapper, NamedParameters

log = logging.getLogger("aiak_training")

BUCKET_ENV_VAR = "AIAK_SHARD_BUCKET_BYTES"
DEFAULT_BUCKET_BYTES = 16 << 20
# Where the full gradients live until their reduce-scatter (docs/sharded-optimizer.md):
# "bounded" (the default) copies each gradient into one of a few reused buffers and frees
# it (memory: a few buckets); "flat" keeps one gradient buffer per bucket, each ``p.grad``
# a view of it (memory: all the gradients, as dense; no copy where autograd accumulates
# into the views).
GRADIENTS_ENV_VAR = "AIAK_SHARD_GRADIENTS"
GRADIENT_MODES = ("bounded", "flat")
# Reduce-scatters in flight at once in backward: each holds a flat copy of a bucket's
# gradients (up to the bucket size).  Without a bound, backward outruns the engine and holds
# nearly every bucket's copy, as much memory as the dense gradients.
REDUCES_IN_FLIGHT = 2
# How long backward waits for the oldest reduce-scatter before it stops bounding them (for
# good, on this optimizer): ranks whose buckets become ready in different orders (a parameter
# unused on some ranks only) could otherwise each wait for one the other has not started.
REDUCE_WAIT_S = 5.0
# In _handles: a bucket whose reduce-scatter finished in backward (its result is in
# bucket.grad already).
_REDUCED = object()

CONSOLIDATE_FIRST = (
    "state_dict() of an optimizer with shard_optimizer_state=True: each rank holds only its "
    "shard of the state. Call optimizer.consolidate_state_dict() on every rank first (a "
    "collective), then state_dict() on any rank, e.g. before "
    "`if hvd.rank() == 0: torch.save(...)`. The consolidated copy is dropped by the next step().")


def _elementwise_classes() -> Tuple[type, ...]:
    """Optimizer classes whose step updates each element from its own gradient and state."""
    from aiak_training.fused_optim import FusedAdam, FusedAdamW, FusedSGD
    return _overlap._torch_safe_classes() + (FusedSGD, FusedAdam, FusedAdamW)


def _norm_hooked_classes() -> Tuple[type, ...]:
    """Optimizer classes that need whole-tensor norms, stepped by ``sharded_lamb.py``."""
    from aiak_training.fused_optim import FusedLAMB
    return (FusedLAMB,)


# Sharded optimizers whose step() may have left allgathers in flight (overlap_allgather).
_OVERLAPPED: "weakref.WeakSet[ShardedStrategy]" = weakref.WeakSet()


def wait_for_all_parameters() -> None:
    """Finish every sharded optimizer's allgathers still in flight: for code that reads
    parameters outside the model's hooks (``hvd.broadcast_parameters``)."""
    for optimizer in list(_OVERLAPPED):
        optimizer.wait_for_parameters()


STALE_READ = (
    "shard_optimizer_state=True: parameter {} got a gradient while its updated value from the "
    "last step() was still being allgathered, so the forward pass read its old value. With "
    "overlap_allgather(model), a module's forward waits only for the parameters it owns; a "
    "forward that uses another module's parameters must call optimizer.wait_for_parameters() "
    "first.")


def _per_element(key: str, value: Any, p: torch.Tensor) -> bool:
    """Whether state entry ``key`` holds one value per element of ``p`` (sliced with it)."""
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == p.shape


class _Bucket:
    """Consecutive parameters reduced together, and this rank's shard of them.

    The bucket owns its parameters' storage: ``flat`` is their flat concatenation (padded to
    a multiple of N) and each parameter's ``.data`` is a view of its slice, so the allgather
    of the updated shards writes the parameters in place, with no copy back."""

    def __init__(self, index: int, group: int, params: List[torch.Tensor], name: str,
                 nranks: int, me: int, flat_grads: bool):
        self.group = group
        self.params = params
        self.name = f"sharded.{index}.{name}"
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.offset_of = dict(zip(params, self.offsets))
        self.shard = max(1, -(-total // nranks))
        self.padded = self.shard * nranks
        self.lo = lo = me * self.shard
        first = params[0]
        self.flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.views: List[torch.Tensor] = []
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                view = self.flat[off:off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
                self.views.append(view)
        # This rank's slice of the storage: the optimizer steps it where it lies (the
        # parameters see each update at once) and the allgather sends it in place.
        self.mine = self.flat[lo:lo + self.shard]
        # "flat" gradients: the bucket's gradient buffer and each parameter's view of it.
        self.flat_grad: Optional[torch.Tensor] = None
        self.grad_view_of: Dict[torch.Tensor, torch.Tensor] = {}
        if flat_grads:
            self.flat_grad = torch.zeros_like(self.flat)
            self.grad_view_of = {p: self.flat_grad[off:off + p.numel()].view_as(p)
                                 for p, off in zip(params, self.offsets)}
        # The shard's reduced gradient.  (MPICH's in-place reduce-scatter, which would leave
        # it at the start of the flat gradient buffer, was 1.3x slower for 16 MiB buckets.)
        self.grad = torch.zeros_like(self.mine)
        # ("bounded" mode) The reused buffer this bucket's gradients are copied into as they
        # arrive, from the first one until the reduce-scatter starts, and the parameters
        # already copied in this step.
        self.staging: Optional[torch.Tensor] = None
        self.staged: set = set()
        self.ready = 0
        # Parameters whose gradient was missing when the bucket was last reduced.
        self.missing: set = set()
        # (parameter, start, stop within the flattened parameter, piece of self.mine)
        self.pieces: List[Tuple[torch.Tensor, int, int, torch.Tensor]] = []
        for p, off in zip(params, self.offsets):
            a, b = max(lo, off), min(lo + self.shard, off + p.numel())
            if a < b:
                piece = self.flat[a:b]
                piece.grad = self.grad[a - lo:b - lo]
                self.pieces.append((p, a - off, b - off, piece))

    def reattach(self, names: Dict[torch.Tensor, str]) -> None:
        """Make every parameter a view of ``flat`` again where the user replaced its
        ``.data`` (``p.data = t``, ``model.to()`` to another dtype or device), keeping the
        value it now has."""
        for p, view in zip(self.params, self.views):
            if p.data_ptr() == view.data_ptr() and p.dtype == view.dtype \
                    and p.device == view.device:
                continue
            if (p.dtype, p.device, p.shape) != (view.dtype, view.device, view.shape):
                raise ValueError(
                    f"shard_optimizer_state=True: parameter {names.get(p)} changed from "
                    f"{view.dtype} {tuple(view.shape)} on {view.device} to {p.dtype} "
                    f"{tuple(p.shape)} on {p.device} after the optimizer was built; move or "
                    "convert the model (model.to()) before building the DistributedOptimizer.")
            with torch.no_grad():
                view.copy_(p.detach())
            p.data = view

    def adopt_gradient(self, p: torch.Tensor) -> None:
        """("flat" mode) Make ``p.grad`` its view of the gradient buffer, copying the value in
        where autograd put it in a tensor of its own (``p.grad`` was None: ``zero_grad()``'s
        default).  Called as soon as the gradient is accumulated, so that tensor is freed at
        once and the allocator reuses its memory for the next one (held until the bucket is
        ready, the pages went back to the system and were faulted in again every step), and
        later backward passes accumulate into the buffer in place."""
        view = self.grad_view_of[p]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(p.grad)
            p.grad = view

    def gradients_in_place(self) -> torch.Tensor:
        """("flat" mode) The bucket's gradient buffer holding its gradients: zeros where a
        gradient is missing (``p.grad`` stays None, as with the dense optimizer)."""
        assert self.flat_grad is not None
        for p, view in self.grad_view_of.items():
            if p.grad is None:
                view.zero_()
            else:
                self.adopt_gradient(p)  # a gradient set by hand since backward
        return self.flat_grad

    def stage_gradient(self, p: torch.Tensor) -> None:
        """("bounded" mode) Add ``p.grad`` into its place in the staging buffer (a copy for
        its first backward pass of the step) and free it.  Freed at once, its memory is what
        the allocator hands out for the next gradient: held until the bucket was ready, the
        freed pages went back to the system and were faulted in again every step (a fifth of
        the step of the ResNet-50 set at 2 ranks)."""
        assert self.staging is not None
        off = self.offset_of[p]
        part = self.staging[off:off + p.numel()].view_as(p)
        with torch.no_grad():
            if p in self.staged:
                part.add_(p.grad)
            else:
                part.copy_(p.grad)
                self.staged.add(p)
        p.grad = None

    def staged_gradient(self) -> torch.Tensor:
        """("bounded" mode) The padded staging buffer holding the bucket's gradients: those
        set by hand since backward copied in, zeros where a gradient is missing."""
        assert self.staging is not None
        for p, off in zip(self.params, self.offsets):
            if p in self.staged:
                continue
            part = self.staging[off:off + p.numel()]
            if p.grad is not None:
                part.copy_(p.grad.reshape(-1))
                p.grad = None
            else:
                part.zero_()
        self.staging[self.offsets[-1] + self.params[-1].numel():self.padded].zero_()
        self.staged.clear()
        return self.staging[:self.padded]


class ShardedStrategy(DistributedWrapper):
    """The sharded strategy of the distributed-optimizer wrapper (module docstring)."""

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
        self._flat_grads = env_choice(GRADIENTS_ENV_VAR, "bounded", GRADIENT_MODES) == "flat"
        self._buckets = self._make_buckets(env_bytes(BUCKET_ENV_VAR, DEFAULT_BUCKET_BYTES, 1))
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        for p in self._bucket_of:
            self._requires_update.add(p)
            self._grad_accs.append(self._attach_hook(p))
        # FusedLAMB: each piece's row in the table of per-parameter norms (sharded_lamb.py).
        self._lamb_rows: Optional[Dict[torch.Tensor, int]] = None
        if base in _norm_hooked_classes():
            row = {p: i for i, p in enumerate(self._bucket_of)}  # bucket order, on every rank
            self._lamb_rows = {piece: row[p] for b in self._buckets for p, _, _, piece in b.pieces}
        # Allgathers started by step() and not yet waited for (their handles, in the order
        # they were started, _gather_order), and the module hooks that wait for them
        # (overlap_allgather).
        self._gathers: Dict[_Bucket, Any] = {}
        self._gather_order: List[_Bucket] = list(self._buckets)
        self._model_hooks: List[Any] = []
        # Reduce-scatter inputs, reused from step to step (sharded_io.py): enough for the
        # reduce-scatters in flight plus the one starting.
        self._buffers = BufferCache(REDUCES_IN_FLIGHT + 1)
        # Every buffer is as large as the largest bucket of its dtype and device, so that
        # any of them serves any bucket.
        self._buffer_numel: Dict[Tuple[torch.dtype, torch.device], int] = {}
        for b in self._buckets:
            kind = (b.flat.dtype, b.flat.device)
            self._buffer_numel[kind] = max(self._buffer_numel.get(kind, 0), b.padded)
        self._bound_reduces = True  # False after a wait for the oldest one timed out

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
                                               size(), rank(), self._flat_grads))
                        run, nbytes = [], 0
                    if p is not None:
                        run.append(p)
                        nbytes += p.numel() * p.element_size()
        return buckets

    # ---- backward: reduce-scatter each bucket once all its gradients are in -----------------
    def _gradient_ready(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of[p]
        if bucket in self._gathers:
            self.wait_for_parameters()  # leave the model consistent before failing
            raise RuntimeError(STALE_READ.format(self._parameter_names.get(p)))
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(hs.TOO_MANY_BACKWARD_PASSES)
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(f"shard_optimizer_state=True: the gradient of "
                             f"{self._parameter_names.get(p)} is sparse (e.g. "
                             "Embedding(sparse=True)); sharding needs dense gradients.")
        if self._flat_grads:
            bucket.adopt_gradient(p)
        elif p.grad is not None:
            self._stage(bucket).stage_gradient(p)
        self._allreduce_delay[p] -= 1
        self._handles.setdefault(bucket, (None, None))
        if self._allreduce_delay[p] == 0:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"shard_optimizer_state=True: the gradient of "
                                 f"{self._parameter_names.get(p)} is sparse.")
        bucket.missing = {p for p in bucket.params
                          if p.grad is None and p not in bucket.staged}
        pre, post = self._scale_factors()
        if self._flat_grads:
            # Reduced in place from the bucket's own buffer: no copy (unless autograd put a
            # gradient elsewhere), nothing to bound.
            handle = reducescatter_into(bucket.gradients_in_place(), bucket.grad, bucket.name,
                                        self.op, pre, post, self.process_set)
            self._handles[bucket] = (handle, None)
            bucket.ready = 0
            return
        buf = self._stage(bucket).staging
        flat = bucket.staged_gradient()  # every p.grad is None from here on
        bucket.staging = None
        # The result goes straight into the shard's gradient buffer: nothing is pooled.
        handle = reducescatter_into(flat, bucket.grad, bucket.name, self.op, pre, post,
                                    self.process_set)
        self._handles[bucket] = (handle, buf)
        bucket.ready = 0
        self._reap()
        if self._bound_reduces:
            self._bound_in_flight()

    def _bound_in_flight(self) -> None:
        """Wait for the oldest reduce-scatters until at most REDUCES_IN_FLIGHT run, so that
        their input buffers are reused rather than one allocated per bucket."""
        running = [(b, h, f) for b, (h, f) in self._handles.items()
                   if h is not None and h is not _REDUCED]
        for bucket, handle, flat in running[:max(0, len(running) - REDUCES_IN_FLIGHT)]:
            deadline, pause = time.monotonic() + REDUCE_WAIT_S, 1e-4
            while not poll(handle):
                if time.monotonic() > deadline:
                    self._bound_reduces = False
                    log.warning("sharded optimizer: the reduce-scatter of %s did not finish "
                                "within %.0f s of a later bucket's; reduce-scatters are no "
                                "longer bounded to %d in flight, so backward may hold more "
                                "gradient copies (ranks whose buckets become ready in "
                                "different orders cause this)", bucket.name, REDUCE_WAIT_S,
                                REDUCES_IN_FLIGHT)
                    return
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)  # each wait overshoots by at most this
            self._finish_reduce(bucket, handle, flat)

    def _stage(self, bucket: _Bucket) -> _Bucket:
        """``bucket``, with a staging buffer from the first gradient of the step on."""
        if bucket.staging is None:
            bucket.staging = self._take_buffer(bucket)
        return bucket

    def _take_buffer(self, bucket: _Bucket) -> torch.Tensor:
        """A reused flat buffer that holds at least ``bucket.padded`` elements."""
        w = bucket.flat
        return self._buffers.take(self._buffer_numel[(w.dtype, w.device)], w)

    def _reap(self) -> None:
        """Give back the input buffers of the reduce-scatters that have finished, so that
        backward reuses them for the next buckets instead of holding one per bucket until
        ``synchronize()``.  Only polls: waiting here could deadlock ranks whose buckets
        become ready in different orders."""
        for bucket, (handle, flat) in list(self._handles.items()):
            if handle is not None and handle is not _REDUCED and poll(handle):
                self._finish_reduce(bucket, handle, flat)

    def _finish_reduce(self, bucket: _Bucket, handle: Any, buf: Optional[torch.Tensor]
                       ) -> None:
        synchronize(handle)  # wrote bucket.grad
        if buf is not None:
            self._buffers.give(buf)
        self._handles[bucket] = (_REDUCED, None)  # still pending for zero_grad's check

    def synchronize(self) -> None:
        """Finish every bucket's reduce-scatter (starting those backward did not), leaving
        this rank's shard of the reduced gradient for ``step()``.  The model's ``p.grad`` are
        then None (bounded gradients) or this rank's own unreduced gradients (flat ones):
        use :meth:`clip_grad_norm_` to clip."""
        self.wait_for_parameters()
        for bucket in self._buckets:  # the same order on every rank
            handle, _ = self._handles.get(bucket, (None, None))
            if handle is None:
                self._start(bucket)
        for bucket in self._buckets:
            handle, flat = self._handles.pop(bucket)
            if handle is not _REDUCED:
                self._finish_reduce(bucket, handle, flat)
            for p in bucket.params:
                self._rearm(p)
        self._handles.clear()
        self._synchronized = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients (call after :meth:`synchronize`, then step inside
        :meth:`skip_synchronize`) by their global norm over all shards, as
        ``torch.nn.utils.clip_grad_norm_`` would on the full averaged gradients.  A collective;
        returns the total norm."""
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
        self.wait_for_parameters()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._synchronize_for_step()
        for b in self._buckets:
            b.reattach(self._parameter_names)
        with self._on_shard():
            if self._lamb_rows is None:
                self._wrapped_step()
            else:
                from aiak_training.torch.sharded_lamb import step_on_pieces
                step_on_pieces(self, self._lamb_rows, len(self._bucket_of), "sharded.lamb")
        # Every bucket's allgather starts now, in the same order on every rank.  Each sends
        # this rank's slice from where the optimizer just updated it and writes the others'
        # into the parameters' storage, in place: no buffer, and nothing bounds how many run
        # at once.
        for b in self._gather_order:
            self._gathers[b] = allgather_into(b.mine, b.flat, f"{b.name}.gather",
                                              self.process_set)
        self._consolidated = None
        if not self._model_hooks:
            self.wait_for_parameters()
        return loss

    # ---- the allgather overlapping the next forward pass ------------------------------------
    def _wait(self, buckets: Iterable[_Bucket]) -> None:
        """Wait until the allgathers of ``buckets`` (those still pending) have written the
        parameters.  Every rank started all of them in ``step()``, so waiting for any one,
        in any order, never waits for a rank that has not got there: no deadlock, whatever
        order the forward pass asks in."""
        for b in buckets:
            handle = self._gathers.pop(b, None)
            if handle is not None:
                synchronize(handle)

    def _pending_gathers(self) -> List[_Bucket]:
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
        order: List[_Bucket] = []  # buckets in the order the model's modules come
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
        self.wait_for_parameters()
        super().load_state_dict(state_dict)
        for b in self._buckets:  # gradients staged for the replaced state go with it
            if b.staging is not None:
                self._buffers.give(b.staging)
            b.staging, b.ready = None, 0
            b.staged.clear()
        self._shard_state()
        self._consolidated = None

    def state_dict(self) -> Dict[str, Any]:
        """The full state gathered by the last :meth:`consolidate_state_dict`; never
        communicates, raises ``RuntimeError`` when there is none since the last step."""
        self.wait_for_parameters()
        if self._consolidated is None:
            raise RuntimeError(CONSOLIDATE_FIRST)
        return self._consolidated

    @collective_helper("consolidate_state_dict")
    def consolidate_state_dict(self) -> Dict[str, Any]:
        """Gather the full optimizer state, in the plain optimizer's format, on every rank.

        A collective: call it on every rank (then ``state_dict()`` returns the result until the
        next ``step()``).  Called on some ranks only, it leaves the others waiting, and by
        default the job stops with a deadlock error naming this method.  Memory: the full state is held on every rank while it lives."""
        from aiak_training.torch.functions import allgather_object
        self.wait_for_parameters()
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
                flat = torch.zeros(b.shard, dtype=dtype, device=b.flat.device)
                lo = b.mine.storage_offset()
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
        self.wait_for_parameters()
        options = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        for g, opts in zip(self.param_groups,
                           broadcast_object(options, root_rank, name="sharded.options")):
            g.update(opts)
