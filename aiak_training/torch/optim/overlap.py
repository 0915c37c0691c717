"""Overlapping the parameter update with gradient communication (``overlap_update``).

Horovod's ``DistributedOptimizer.step()`` waits for every gradient's allreduce and then updates
all parameters: while the last buckets are on the wire the processor idles, and during the
update the network idles.  With ``overlap_update`` on, ``step()`` instead waits for *whichever*
reduction completes next (:meth:`Engine.wait_any`), puts that bucket's averaged gradients in
place exactly as ``synchronize()`` does, and runs the wrapped optimizer on just those parameters
while the remaining buckets are still being reduced by the engine thread (MPI and the engine's
kernels release the GIL, so the two really run at the same time).

Why the result is bit-for-bit the synchronous one:

* every bucket is updated by the wrapped optimizer's own ``step()``, with each param group's
  ``params`` temporarily cut down to the bucket's parameters (in their original order).  The
  optimizers allowed here update each parameter from its own gradient and state only, with a
  per-parameter ``step`` count, so the same operations run on the same values; only their
  grouping into calls changes;
* a parameter is updated only after its own reduction has completed and its gradient has been
  finalized (decompressed, copied back), never twice, and every parameter the synchronous path
  would update (including those whose gradient was never produced and is reduced as zeros, and
  those with a gradient but no hook) is updated once;
* everything happens inside ``step()``, so hyper-parameters (an LR scheduler's ``lr``) are
  read at the same point as before, and ``synchronize()``/``zero_grad()`` keep their meaning.
  Updates are not started from the backward hooks, because at hook time nobody knows whether
  the user will clip, unscale or inspect the gradients before ``step()``.

With CUDA gradients nothing here waits for the device.  The engine reports a GPU reduction
done once its collective is enqueued and a completion event recorded; finishing a reduction
(``synchronize``) makes the current stream wait for that event on the device
(:func:`aiak_training.torch.cuda.consume`), and the bucket's update is then issued on the
same stream, so the device runs it after its reduction while the host goes on to the next
completion.  The loop reads no tensor on the host and calls no stream, event or device
synchronize (tests/parallel/test_overlap.py counts them); only the wrapped optimizer's own
step does what it would do in the synchronous path.

When the update cannot be split exactly, the step falls back to the synchronous path and says
why once per optimizer (see :data:`FALLBACK_REASONS`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from aiak_training.common.env import env_bool, env_bytes
from aiak_training.common.tuning import OVERLAP_UPDATE
from aiak_training.torch.optim.wrapper import restricted_groups


log = logging.getLogger("aiak_training")

#: Environment variable that turns overlap on when ``overlap_update`` is not given
#: (``aiakrun --overlap-update`` sets it).
ENV_VAR = OVERLAP_UPDATE.variable
#: Smallest amount of completed gradient (bytes) updated on its own while other reductions
#: are still pending.
MIN_BUCKET_ENV_VAR = "AIAK_OVERLAP_MIN_BUCKET_BYTES"
DEFAULT_MIN_BUCKET_BYTES = 8 << 20  # measured: smaller buckets cost more than they hide on one node

#: Why a step ran synchronously.  Keys are what :class:`OverlapStats` counts.
FALLBACK_REASONS: Dict[str, str] = {
    "synchronized": "optimizer.synchronize() was called before step() (gradient clipping, "
                    "GradScaler.unscale_ or other use of the reduced gradients), so all "
                    "reductions had finished before the update",
    "closure": "step() was given a closure, which re-evaluates the loss and gradients",
    "grad_scaler": "a GradScaler handed grad_scale/found_inf to the optimizer (fp16 loss "
                   "scaling: the inf check needs every gradient before any update)",
    "step_hooks": "optimizer step pre/post hooks are registered, and they expect to see the "
                  "whole step",
    "sparse": "a gradient is sparse",
    "lamb_global_norm": "FusedLAMB clips by the global gradient norm (max_grad_norm > 0), "
                        "which needs every gradient before any update",
    "optimizer": "the wrapped optimizer is not known to update each parameter independently "
                 "(set aiak_overlap_update_safe = True on its class if it does)",
    "replaced": "this distributed optimizer's step/synchronize/hooks are replaced by a "
                "subclass or compressor (e.g. DGC)",
    "dgc": "DGC compression builds its own distributed optimizer with a sparse exchange",
}


def _torch_safe_classes() -> Tuple[type, ...]:
    """torch.optim classes whose step() updates each parameter from its own gradient and state
    (per-parameter ``step`` counts), so that stepping any subset is exact."""
    names = ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta")
    return tuple(getattr(torch.optim, n) for n in names if hasattr(torch.optim, n))


def _fused_classes() -> Dict[type, Optional[Callable[[Any], Optional[str]]]]:
    """aiak fused optimizers, each with a per-step check (None: always exact)."""
    try:
        from aiak_training.fused_optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD
    except ImportError:  # pragma: no cover - the extension may be missing in odd builds
        return {}

    def lamb_check(opt: Any) -> Optional[str]:
        mgn = opt.defaults.get("max_grad_norm")
        return "lamb_global_norm" if mgn is not None and mgn > 0 else None
    return {FusedSGD: None, FusedAdam: None, FusedAdamW: None, FusedLAMB: lamb_check}


def requested(overlap_update: Optional[bool]) -> bool:
    """The argument if given, else ``AIAK_OVERLAP_UPDATE``."""
    return env_bool(ENV_VAR) if overlap_update is None else bool(overlap_update)


@dataclass
class OverlapStats:
    """What overlapped stepping did, cumulatively.  Times are seconds (``time.monotonic``).

    ``hidden_update_s`` is the part of ``update_s`` (time in the wrapped optimizer's step during
    overlapped steps) that ran before the step's last reduction completed, by the engine's
    completion timestamps: update work that was hidden behind communication.
    """
    steps: int = 0                  # step() calls seen with overlap on
    overlapped_steps: int = 0
    fallback_steps: Dict[str, int] = field(default_factory=dict)
    buckets: int = 0                # partial updates run in overlapped steps
    param_updates: int = 0          # parameters updated in overlapped steps (each once per step)
    update_s: float = 0.0
    hidden_update_s: float = 0.0
    wait_s: float = 0.0             # time step() spent blocked waiting for reductions

    @property
    def hidden_update_fraction(self) -> float:
        return self.hidden_update_s / self.update_s if self.update_s > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        return {"steps": self.steps, "overlapped_steps": self.overlapped_steps,
                "fallback_steps": dict(self.fallback_steps), "buckets": self.buckets,
                "param_updates": self.param_updates, "update_s": self.update_s,
                "hidden_update_s": self.hidden_update_s, "wait_s": self.wait_s,
                "hidden_update_fraction": self.hidden_update_fraction}


def log_fallback_once(logged: Set[str], reason: str) -> None:
    if reason not in logged:
        logged.add(reason)
        log.warning("overlap_update: using the synchronous update because %s. "
                    "(Logged once per optimizer.)", FALLBACK_REASONS[reason])


class Overlap:
    """Per-optimizer overlap state: the class check, the fallback log, the statistics."""

    def __init__(self, check: Optional[Callable[[Any], Optional[str]]]):
        self._check = check
        # Completed gradients are updated together until they reach this many bytes (or
        # nothing else is pending), so a trickle of small completions does not cost one
        # optimizer call each.
        self.min_bucket_bytes = env_bytes(MIN_BUCKET_ENV_VAR, DEFAULT_MIN_BUCKET_BYTES)
        self.stats = OverlapStats()
        self.logged: Set[str] = set()

    # ---- eligibility ---------------------------------------------------------------------
    @staticmethod
    def static_reason(opt: torch.optim.Optimizer
                      ) -> Tuple[Optional[str], Optional[Callable[[Any], Optional[str]]]]:
        """(reason overlap can never apply to ``opt``, per-step check of its class).

        Only a reduction strategy that declares ``_aiak_overlap_ok`` (the allreduce one, whose
        step, hooks and reductions this path was written against) qualifies: DGC does not."""
        view = opt.reduction_view()
        if not view.overlap_ok:
            return "replaced", None
        base = view.wrapped_class  # the user's optimizer class (see wrapper.wrap)
        if base.__dict__.get("aiak_overlap_update_safe", False):
            return None, None
        fused = _fused_classes()
        if base in fused:
            return None, fused[base]
        if base in _torch_safe_classes():
            return None, None
        return "optimizer", None

    def step_reason(self, opt: torch.optim.Optimizer, closure: Any) -> Optional[str]:
        """Why this particular step must be synchronous, or None."""
        view = opt.reduction_view()
        if view.synchronized:
            return "synchronized"
        if closure is not None:
            return "closure"
        if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
            return "grad_scaler"
        if view.step_hooks:
            return "step_hooks"
        if self._check is not None:
            reason = self._check(opt)
            if reason is not None:
                return reason
        for p in view.parameters:
            g = p.grad
            if g is not None and g.is_sparse:
                return "sparse"
        return None

    def fallback(self, reason: str) -> None:
        self.stats.fallback_steps[reason] = self.stats.fallback_steps.get(reason, 0) + 1
        log_fallback_once(self.logged, reason)

    # ---- the overlapped step ---------------------------------------------------------------
    def step(self, opt: torch.optim.Optimizer, base_step: Callable[[], Any]) -> None:
        """Reduce-and-update bucket by bucket.  ``base_step()`` is the wrapped optimizer's step."""
        from aiak_training.runtime import current
        engine = current.engine()
        stats = self.stats
        view = opt.reduction_view()
        handles = view.start_pending()
        if any(callable(h) for h, _ in handles.values()):
            # A sparse allreduce (a callable, not an engine handle) started from a hook: finish
            # synchronously, before anything was updated.
            self.fallback("sparse")
            for key, (handle, ctx) in handles.items():
                view.finish(key, handle, ctx)
            handles.clear()
            base_step()
            return

        groups = opt.param_groups
        index: Dict[torch.Tensor, Tuple[int, int]] = {}
        for gi, group in enumerate(groups):
            for pi, p in enumerate(group["params"]):
                index[p] = (gi, pi)
        pending: Dict[int, Any] = {handle: key for key, (handle, _) in handles.items()}
        updated: Set[torch.Tensor] = set()
        intervals: List[Tuple[float, float]] = []
        last_done = 0.0
        wait_s = 0.0
        min_bytes = self.min_bucket_bytes
        params: List[torch.Tensor] = []
        nbytes = 0
        try:
            while pending:
                t = time.monotonic()
                ready = engine.wait_any(list(pending))
                wait_s += time.monotonic() - t
                for h in ready:
                    done_at = engine.completion_time(h)
                    if done_at is not None and done_at > last_done:
                        last_done = done_at
                    key = pending.pop(h)
                    handle, ctx = handles.pop(key)
                    view.finish(key, handle, ctx)
                    for p in (key if isinstance(key, tuple) else (key,)):
                        params.append(p)
                        nbytes += p.numel() * p.element_size()
                if pending and nbytes < min_bytes:
                    continue  # too little for a step call of its own: gather more first
                t0 = time.monotonic()
                self._update_subset(groups, index, params, updated, base_step)
                intervals.append((t0, time.monotonic()))
                params, nbytes = [], 0
        except BaseException:
            # Leave the remaining reductions as synchronize() would (finished, gradients in
            # place, delay counters reset), so the next backward or zero_grad() is consistent.
            for key, (handle, ctx) in list(handles.items()):
                try:
                    view.finish(key, handle, ctx)
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    pass
            raise
        finally:
            handles.clear()
        # Parameters that have a gradient but were not reduced (no hook: requires_grad set
        # later, or added with add_param_group) are updated by the synchronous path too.
        leftovers = [p for g in groups for p in g["params"]
                     if p.grad is not None and p not in updated]
        if leftovers:
            t0 = time.monotonic()
            self._update_subset(groups, index, leftovers, updated, base_step)
            intervals.append((t0, time.monotonic()))
        stats.overlapped_steps += 1
        stats.buckets += len(intervals)
        stats.param_updates += len(updated)
        stats.wait_s += wait_s
        for t0, t1 in intervals:
            stats.update_s += t1 - t0
            stats.hidden_update_s += max(0.0, min(t1, last_done) - t0)

    @staticmethod
    def _update_subset(groups: List[Dict[str, Any]], index: Dict[torch.Tensor, Tuple[int, int]],
                       params: List[torch.Tensor], updated: Set[torch.Tensor],
                       base_step: Callable[[], Any]) -> None:
        """Run the wrapped optimizer's step with every param group restricted to ``params``."""
        mine = []
        for p in params:
            if p not in index:
                continue  # reduced for the user, but not this optimizer's parameter
            if p in updated:
                raise RuntimeError("overlap_update: internal error, a parameter would be "
                                   "updated twice in one step")
            updated.add(p)
            mine.append(p)
        if not mine:
            return
        with restricted_groups(groups, mine):
            base_step()
