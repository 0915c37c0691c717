"""Buckets and packed storage of the sharded strategy.

The trainable parameters are cut into buckets (per param group, dtype and device kind, in
name order, up to ``AIAK_SHARD_BUCKET_BYTES``).  A :class:`Bucket` owns its parameters'
storage, one packed buffer padded to a multiple of the world size, of which this rank owns one
contiguous slice (the shard); it also holds the gradient buffers of either gradient mode.
:class:`BufferCache` keeps the transient packed buffers of the reduce-scatters for reuse.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from aiak_training.common.env import env_choice
from aiak_training.torch.mpi_ops import rank, size

BUCKET_ENV_VAR = "AIAK_SHARD_BUCKET_BYTES"
DEFAULT_BUCKET_BYTES = 16 << 20
# Where the full gradients live until their reduce-scatter (docs/sharded-optimizer.md):
# "bounded" (the default) copies each gradient into one of a few reused buffers and frees
# it (memory: a few buckets); "kept" keeps one gradient buffer per bucket, each ``p.grad``
# a view of it (memory: all the gradients, as dense; no copy where autograd accumulates
# into the views).
GRADIENTS_ENV_VAR = "AIAK_SHARD_GRADIENTS"
GRADIENT_MODES = ("bounded", "kept")
# The older name of "kept", still accepted ("flat" now names only the allreduce algorithm).
_OLD_MODE_NAMES = {"flat": "kept"}


def gradient_mode() -> str:
    """``AIAK_SHARD_GRADIENTS``: "bounded" (the default) or "kept"."""
    mode = env_choice(GRADIENTS_ENV_VAR, "bounded", GRADIENT_MODES + tuple(_OLD_MODE_NAMES))
    return _OLD_MODE_NAMES.get(mode, mode)


class Bucket:
    """Consecutive parameters reduced together, and this rank's shard of them.

    The bucket owns its parameters' storage: ``storage`` is their concatenation (padded to
    a multiple of N) and each parameter's ``.data`` is a view of its slice, so the allgather
    of the updated shards writes the parameters in place, with no copy back."""

    def __init__(self, index: int, group: int, params: List[torch.Tensor], name: str,
                 nranks: int, me: int, kept_grads: bool):
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
        self.storage = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.views: List[torch.Tensor] = []
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                view = self.storage[off:off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
                self.views.append(view)
        # This rank's slice of the storage: the optimizer steps it where it lies (the
        # parameters see each update at once) and the allgather sends it in place.
        self.mine = self.storage[lo:lo + self.shard]
        # "kept" gradients: the bucket's gradient buffer and each parameter's view of it.
        self.grad_buffer: Optional[torch.Tensor] = None
        self.grad_view_of: Dict[torch.Tensor, torch.Tensor] = {}
        if kept_grads:
            self.grad_buffer = torch.zeros_like(self.storage)
            self.grad_view_of = {p: self.grad_buffer[off:off + p.numel()].view_as(p)
                                 for p, off in zip(params, self.offsets)}
        # The shard's reduced gradient.  (MPICH's in-place reduce-scatter, which would leave
        # it at the start of the gradient buffer, was 1.3x slower for 16 MiB buckets.)
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
                piece = self.storage[a:b]
                piece.grad = self.grad[a - lo:b - lo]
                self.pieces.append((p, a - off, b - off, piece))

    def reattach(self, names: Dict[torch.Tensor, str]) -> None:
        """Make every parameter a view of ``storage`` again where the user replaced its
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
        """("kept" mode) Make ``p.grad`` its view of the gradient buffer, copying the value in
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
        """("kept" mode) The bucket's gradient buffer holding its gradients: zeros where a
        gradient is missing (``p.grad`` stays None, as with the dense optimizer)."""
        assert self.grad_buffer is not None
        for p, view in self.grad_view_of.items():
            if p.grad is None:
                view.zero_()
            else:
                self.adopt_gradient(p)  # a gradient set by hand since backward
        return self.grad_buffer

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


def make_buckets(param_groups: List[Dict[str, Any]], name_of: Callable[[torch.Tensor], str],
                 limit: int, kept_grads: bool) -> List[Bucket]:
    """The buckets of ``param_groups``' trainable parameters: per param group, dtype and
    device kind, in name order, each up to ``limit`` bytes (the same on every rank)."""
    buckets: List[Bucket] = []
    for gi, group in enumerate(param_groups):
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
                    buckets.append(Bucket(len(buckets), gi, run, name_of(run[0]),
                                          size(), rank(), kept_grads))
                    run, nbytes = [], 0
                if p is not None:
                    run.append(p)
                    nbytes += p.numel() * p.element_size()
    return buckets


class BufferCache:
    """Flat buffers kept for reuse, so that a transient buffer needed every step is allocated
    once rather than once per step.

    A buffer serves any request it is large enough for (the caller slices it), so buckets of
    many different sizes share a few buffers.  Per dtype and device, as many free ones are
    kept as were ever in use at once (at least ``keep``; the smallest go first): a steady
    workload then allocates nothing after its first step, and what stays allocated between
    steps is what its busiest moment needed."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
        self._in_use: Dict[Tuple[torch.dtype, torch.device], int] = {}
        self._peak: Dict[Tuple[torch.dtype, torch.device], int] = {}

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A packed buffer of at least ``numel`` elements of ``like``'s dtype and device
        (contents undefined); give the whole buffer back, not a slice."""
        kind = (like.dtype, like.device)
        self._in_use[kind] = used = self._in_use.get(kind, 0) + 1
        self._peak[kind] = max(self._peak.get(kind, 0), used)
        free = self._free.get(kind, [])
        fits = [i for i, buf in enumerate(free) if buf.numel() >= numel]
        if fits:
            return free.pop(min(fits, key=lambda i: free[i].numel()))
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def give(self, buf: torch.Tensor) -> None:
        """Return ``buf`` (nothing may use it any more) for a later :meth:`take`."""
        kind = (buf.dtype, buf.device)
        self._in_use[kind] = max(0, self._in_use.get(kind, 0) - 1)
        free = self._free.setdefault(kind, [])
        free.append(buf)
        if len(free) > max(self.keep, self._peak.get(kind, 0)):
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))

    def buffers(self) -> List[torch.Tensor]:
        """The free buffers held now."""
        return [buf for free in self._free.values() for buf in free]
