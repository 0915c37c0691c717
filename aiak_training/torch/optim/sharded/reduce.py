"""The backward reduce-scatter of the sharded strategy.

When every gradient of a bucket is ready in backward (after ``backward_passes_per_step``
passes), the bucket is reduce-scattered by the engine straight into the shard's gradient
buffer (``reducescatter_async(out=)``).  With bounded gradients each gradient is added into
a reused staging buffer as soon as autograd has accumulated it, and at most
``REDUCES_IN_FLIGHT`` reduce-scatters run at once; with kept gradients each bucket's own
gradient buffer is reduced in place.  ``synchronize()`` finishes them all.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from aiak_training.torch.mpi_ops import Sum, allreduce, poll, reducescatter_async, synchronize
from aiak_training.torch.optim.sharded.buckets import Bucket

log = logging.getLogger("aiak_training")

# Reduce-scatters in flight at once in backward: each holds a packed copy of a bucket's
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


STALE_READ = (
    "shard_optimizer_state=True: parameter {} got a gradient while its updated value from the "
    "last step() was still being allgathered, so the forward pass read its old value. With "
    "overlap_allgather(model), a module's forward waits only for the parameters it owns; a "
    "forward that uses another module's parameters must call optimizer.wait_for_parameters() "
    "first.")


class ReduceScatter:
    """The sharded strategy's backward hooks, reduce-scatters, ``synchronize()`` and
    ``clip_grad_norm_`` (a part of :class:`ShardedStrategy`, which supplies the fields)."""

    def _gradient_ready(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of[p]
        if bucket in self._gathers:
            self.wait_for_parameters()  # leave the model consistent before failing
            raise RuntimeError(STALE_READ.format(self._parameter_names.get(p)))
        self._passes.refuse_extra(p)
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(f"shard_optimizer_state=True: the gradient of "
                             f"{self._parameter_names.get(p)} is sparse (e.g. "
                             "Embedding(sparse=True)); sharding needs dense gradients.")
        if self._kept_grads:
            bucket.adopt_gradient(p)
        elif p.grad is not None:
            self._stage(bucket).stage_gradient(p)
        last = self._passes.count(p)
        self._handles.setdefault(bucket, (None, None))
        if last:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        for p in bucket.params:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"shard_optimizer_state=True: the gradient of "
                                 f"{self._parameter_names.get(p)} is sparse.")
        bucket.missing = {p for p in bucket.params
                          if p.grad is None and p not in bucket.staged}
        pre, post = self._scale_factors()
        if self._kept_grads:
            # Reduced in place from the bucket's own buffer: no copy (unless autograd put a
            # gradient elsewhere), nothing to bound.
            handle = reducescatter_async(bucket.gradients_in_place(), bucket.name, self.op,
                                         self.process_set, pre, post, out=bucket.grad)
            self._handles[bucket] = (handle, None)
            bucket.ready = 0
            return
        buf = self._stage(bucket).staging
        packed = bucket.staged_gradient()  # every p.grad is None from here on
        bucket.staging = None
        # The result goes straight into the shard's gradient buffer: nothing is pooled.
        handle = reducescatter_async(packed, bucket.name, self.op, self.process_set, pre, post,
                                     out=bucket.grad)
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
        for bucket, handle, packed in running[:max(0, len(running) - REDUCES_IN_FLIGHT)]:
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
            self._finish_reduce(bucket, handle, packed)

    def _stage(self, bucket: Bucket) -> Bucket:
        """``bucket``, with a staging buffer from the first gradient of the step on."""
        if bucket.staging is None:
            bucket.staging = self._take_buffer(bucket)
        return bucket

    def _take_buffer(self, bucket: Bucket) -> torch.Tensor:
        """A reused packed buffer that holds at least ``bucket.padded`` elements."""
        w = bucket.storage
        return self._buffers.take(self._buffer_numel[(w.dtype, w.device)], w)

    def _reap(self) -> None:
        """Give back the input buffers of the reduce-scatters that have finished, so that
        backward reuses them for the next buckets instead of holding one per bucket until
        ``synchronize()``.  Only polls: waiting here could deadlock ranks whose buckets
        become ready in different orders."""
        for bucket, (handle, packed) in list(self._handles.items()):
            if handle is not None and handle is not _REDUCED and poll(handle):
                self._finish_reduce(bucket, handle, packed)

    def _finish_reduce(self, bucket: Bucket, handle: Any, buf: Optional[torch.Tensor]
                       ) -> None:
        synchronize(handle)  # wrote bucket.grad
        if buf is not None:
            self._buffers.give(buf)
        self._handles[bucket] = (_REDUCED, None)  # still pending for zero_grad's check

    def synchronize(self) -> None:
        """Finish every bucket's reduce-scatter (starting those backward did not), leaving
        this rank's shard of the reduced gradient for ``step()``.  The model's ``p.grad`` are
        then None (bounded gradients) or this rank's own unreduced gradients (kept ones):
        use :meth:`clip_grad_norm_` to clip."""
        self.wait_for_parameters()
        for bucket in self._buckets:  # the same order on every rank
            handle, _ = self._handles.get(bucket, (None, None))
            if handle is None:
                self._start(bucket)
        for bucket in self._buckets:
            handle, packed = self._handles.pop(bucket)
            if handle is not _REDUCED:
                self._finish_reduce(bucket, handle, packed)
            for p in bucket.params:
                self._passes.rearm(p)
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
