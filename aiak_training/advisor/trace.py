"""Profiling the user's script for ``aiakrun --advise``, from outside the script.

aiakrun puts :mod:`aiak_training.advisor._site` on the job's ``PYTHONPATH``; its
``sitecustomize`` calls :func:`install`, which (once the script imports it) replaces ``hvd.DistributedOptimizer`` (the
``aiak_training.torch`` attribute, which ``import horovod.torch`` also reaches under
``--horovod-compat``) with :func:`_profiled`.  The script's optimizer then runs **without
communication**: each rank trains locally, so that what is timed is the compute alone.  For
each step it records

* when each gradient became ready (a post-accumulate-grad hook per parameter),
* when ``step()`` was called, and how long the update took,

all relative to the end of the previous ``step()``.  After ``AIAK_ADVISE_WARMUP`` (2) steps
and ``AIAK_ADVISE_STEPS`` (5) timed ones it times the fused optimizer's update on the same
parameters, writes ``rank<N>.json`` into ``AIAK_ADVISE_DIR`` and ends the script with
``SystemExit(0)`` (every rank reaches the same step).  A script that ends earlier leaves a
``rank<N>.json`` saying how many steps it got to, or none if it never built the optimizer.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.abc
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

DIR_ENV = "AIAK_ADVISE_DIR"
STEPS_ENV = "AIAK_ADVISE_STEPS"
WARMUP_ENV = "AIAK_ADVISE_WARMUP"


def _env_int(name: str, default: int) -> int:
    return max(1, int(os.environ.get(name, default)))


def _rank() -> int:
    for name in ("HOROVOD_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    try:
        import aiak_training.torch as hvd
        return hvd.rank()
    except Exception:  # not initialised: a one-process run
        return 0


def _write(doc: Dict[str, Any]) -> None:
    path = os.path.join(os.environ[DIR_ENV], f"rank{_rank()}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


class _Recorder:
    """Times one optimizer's steps; see the module docstring."""

    def __init__(self, optimizer: Any, params: List[Any]):
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        self.ready: Dict[int, float] = {}
        self.last_end: Optional[float] = None
        self.steps: List[Dict[str, Any]] = []
        self.calls = 0
        self.done = False
        self.warmup = _env_int(WARMUP_ENV, 2)
        self.wanted = _env_int(STEPS_ENV, 5)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._mark)
        atexit.register(self._at_exit)

    def _mark(self, p: Any) -> None:
        self.ready[id(p)] = time.perf_counter()

    def step(self, real_step: Any, *args: Any, **kwargs: Any) -> Any:
        call = time.perf_counter()
        out = real_step(*args, **kwargs)
        end = time.perf_counter()
        self.calls += 1
        if self.last_end is not None and self.calls > self.warmup:
            start = self.last_end
            grads = [(p.numel() * p.element_size(), self.ready[id(p)] - start, p.numel())
                     for p in self.params if id(p) in self.ready]
            self.steps.append({"grads": grads, "call_s": call - start, "update_s": end - call})
        self.ready.clear()
        self.last_end = end
        if len(self.steps) >= self.wanted:
            self._finish()
        return out

    def _fused_update_s(self) -> Optional[float]:
        """The fused optimizer's update on these parameters, or None if there is none."""
        from aiak_training.fused_optim import swap
        if swap.fused_class_for(self.optimizer) is None:
            return None
        saved = os.environ.get(swap.ENV_VAR)
        os.environ[swap.ENV_VAR] = "1"
        try:
            fused = swap.maybe_fuse(self.optimizer)
        finally:
            if saved is None:
                os.environ.pop(swap.ENV_VAR)
            else:
                os.environ[swap.ENV_VAR] = saved
        if fused is self.optimizer:
            return None
        fused.step()  # first step allocates the state
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fused.step()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def _finish(self) -> None:
        """Summarise (median over the timed steps), write, and end the script."""
        self.done = True
        order: Dict[int, List[float]] = {}
        sizes: Dict[int, tuple] = {}
        for s in self.steps:
            for i, (nbytes, ready, numel) in enumerate(s["grads"]):
                order.setdefault(i, []).append(ready)
                sizes[i] = (nbytes, numel)
        grads = sorted(((sizes[i][0], statistics.median(r), sizes[i][1])
                        for i, r in order.items()), key=lambda g: g[1])
        _write({"status": "ok", "steps": len(self.steps),
                "grads": [[b, r] for b, r, _ in grads], "numels": [n for _, _, n in grads],
                "call_s": statistics.median(s["call_s"] for s in self.steps),
                "update_s": statistics.median(s["update_s"] for s in self.steps),
                "fused_update_s": self._fused_update_s(),
                "optimizer": type(self.optimizer).__name__})
        raise SystemExit(0)

    def _at_exit(self) -> None:
        if not self.done:
            _write({"status": "short", "steps": self.calls,
                    "wanted": self.warmup + self.wanted})


def _profiled(real: Any) -> Any:
    @functools.wraps(real)
    def DistributedOptimizer(optimizer: Any, named_parameters: Any = None, *args: Any,
                             **kwargs: Any) -> Any:
        if named_parameters is not None:
            params = [p for _, p in named_parameters]
        else:
            params = [p for g in optimizer.param_groups for p in g["params"]]
        rec = _Recorder(optimizer, params)
        real_step = optimizer.step
        optimizer.step = functools.partial(rec.step, real_step)
        # What scripts call on a DistributedOptimizer besides step(): nothing to do locally.
        optimizer.synchronize = lambda: None
        optimizer.skip_synchronize = contextlib.nullcontext
        return optimizer
    return DistributedOptimizer


def _patch(hvd: Any) -> None:
    if not getattr(hvd.DistributedOptimizer, "_aiak_advise", False):
        hvd.DistributedOptimizer = _profiled(hvd.DistributedOptimizer)
        hvd.DistributedOptimizer._aiak_advise = True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``aiak_training.torch`` right after it is first imported.  Lazy, so that the
    Python processes that never import it (aiakrun itself) stay untouched."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # find the real spec with the other finders
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch(module)
        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


_MODULE = "aiak_training.torch"


def install() -> None:
    """Swap ``aiak_training.torch.DistributedOptimizer`` for the profiling one, now or when
    the script imports it."""
    if not os.environ.get(DIR_ENV):
        return
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
