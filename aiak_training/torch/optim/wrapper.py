"""The one distributed-optimizer wrapper behind ``hvd.DistributedOptimizer``.

Horovod's ``DistributedOptimizer`` returns an instance of a class made on the fly as a subclass
of the user's optimizer class, so ``isinstance(opt, type(original))`` and the optimizer's own
``step()`` keep working.  Here that class is ``type(name, (strategy, base), {})``: the MRO is

    dynamic class -> reduction strategy -> ... -> DistributedWrapper -> user's class -> Optimizer

so every strategy method reaches the next one with plain ``super()``, and
``DistributedWrapper`` reaches the wrapped optimizer with ``super(DistributedWrapper, self)``
(:meth:`DistributedWrapper._wrapped_step`), one way for all of them.

``DistributedWrapper`` holds what every strategy shares: parameter names (Horovod's checks),
counting backward passes, attaching the gradient hooks, stepping a subset of the parameters,
``zero_grad``'s race check, ``skip_synchronize`` and resetting on ``load_state_dict``.  A
strategy decides what a ready gradient starts (``_gradient_ready``), what ``synchronize()``
and ``step()`` do: the allreduce (``optim/allreduce.py``), the Adasum delta
(``optim/adasum.py``), the sharded one (``optim/sharded/``) and DGC (``dgc/optimizer.py``).
:func:`wrap` builds the instance for any of them.

Two small pieces are shared the same way: :class:`BackwardPasses` counts the backward passes
of every parameter for all strategies, and :class:`ReductionView` is what ``overlap.py`` may
read of a strategy's in-flight reductions.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from aiak_training.common import horovod_strings as hs
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.torch.mpi_ops import Average

NamedParameters = Iterable[Tuple[str, torch.Tensor]]


@contextmanager
def restricted_groups(groups: List[Dict[str, Any]], keep: Iterable[torch.Tensor]
                      ) -> Iterator[None]:
    """Inside the block each param group lists only the parameters of ``keep`` it had, in its
    own order: a wrapped ``step()`` then updates exactly those.  The lists are put back after."""
    kept = {id(p) for p in keep}
    saved = [g["params"] for g in groups]
    try:
        for g, params in zip(groups, saved):
            g["params"] = [p for p in params if id(p) in kept]
        yield
    finally:
        for g, params in zip(groups, saved):
            g["params"] = params


def find_duplicates(items: Iterable) -> set:
    """The items that occur more than once in ``items``."""
    seen, repeated = set(), set()
    for item in items:
        (repeated if item in seen else seen).add(item)
    return repeated


class BackwardPasses:
    """How many backward passes each parameter still accumulates before its gradient is
    reduced (``backward_passes_per_step``), for every strategy.

    Each gradient hook calls :meth:`count`; the strategy re-arms a parameter with
    :meth:`rearm` once its reduction is finished."""

    def __init__(self, params: Iterable[torch.Tensor], per_step: int):
        self.per_step = per_step
        self._left = {p: per_step for p in params}

    def left(self, p: torch.Tensor) -> int:
        """Passes ``p`` still accumulates before its gradient is reduced."""
        return self._left[p]

    def refuse_extra(self, p: torch.Tensor) -> None:
        """Raise Horovod's error when ``p`` already had every pass of this step."""
        if self._left[p] <= 0:
            raise AssertionError(hs.TOO_MANY_BACKWARD_PASSES)

    def count(self, p: torch.Tensor, refuse_extra: bool = True) -> bool:
        """Record one backward pass of ``p``; True when it was the last one of the step.
        With ``refuse_extra`` False a pass too many fails a bare assertion instead of
        Horovod's message (the allreduce strategy's rule before a reduction has started)."""
        if refuse_extra:
            self.refuse_extra(p)
        assert self._left[p] > 0
        self._left[p] -= 1
        return self._left[p] == 0

    def rearm(self, p: torch.Tensor) -> None:
        """Start counting ``p``'s passes of the next step."""
        self._left[p] = self.per_step

    def rearm_all(self, per_step: Optional[int] = None) -> None:
        """Start counting every parameter's passes again (with a new ``per_step`` if given)."""
        if per_step is not None:
            self.per_step = per_step
        self._left.update(dict.fromkeys(self._left, self.per_step))


class ReductionView:
    """What ``overlap.py`` reads of an allreduce strategy, so that it touches none of the
    strategy's private fields: whether this step's gradients are already synchronized, the
    parameters it reduces, its reductions in flight, and how to start and finish them.

    The step hooks it reports are torch's private dictionaries (``Optimizer``'s
    ``_optimizer_step_pre_hooks``/``_optimizer_step_post_hooks`` and the module-level
    global ones): torch offers ways to register step hooks but none to list them, so this
    is the one place that reads them."""

    def __init__(self, opt: "DistributedWrapper"):
        self._opt = opt

    @property
    def wrapped_class(self) -> type:
        """The user's optimizer class (see :func:`wrap`)."""
        return type(self._opt)._aiak_wrapped_class

    @property
    def overlap_ok(self) -> bool:
        """Whether the strategy's step may be split by the overlapped update."""
        return bool(getattr(type(self._opt), "_aiak_overlap_ok", False))

    @property
    def synchronized(self) -> bool:
        """True when ``synchronize()`` already ran for this step (or the step runs inside
        ``skip_synchronize()``): every reduction has finished before the update."""
        return self._opt._synchronized or not self._opt._should_synchronize

    @property
    def parameters(self) -> set:
        """The parameters whose gradients the strategy reduces."""
        return self._opt._requires_update

    @property
    def step_hooks(self) -> bool:
        """Whether optimizer step pre/post hooks are registered, on this optimizer or
        globally."""
        from torch.optim import optimizer as _topt
        opt = self._opt
        return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                    or _topt._global_optimizer_pre_hooks or _topt._global_optimizer_post_hooks)

    def start_pending(self) -> Dict[Any, Tuple[Any, Any]]:
        """Start every reduction the hooks did not; returns the reductions in flight, keyed
        by parameter (or tuple of parameters): ``(handle, context)``.  The dict is the
        strategy's own: entries taken out of it are finished by the caller."""
        self._opt._submit_pending()
        return self._opt._handles

    def finish(self, key: Any, handle: Any, ctx: Any) -> None:
        """Wait for one reduction and put its reduced gradient(s) in place."""
        self._opt._finish_reduction(key, handle, ctx)


class DistributedWrapper(torch.optim.Optimizer):
    """Shared part of every distributed optimizer; never instantiated on its own (a strategy
    subclass and the user's optimizer class complete it, see :func:`wrap`)."""

    _aiak_distributed = True
    #: Whether ``overlap_update`` may split this strategy's step (optim/overlap.py).
    _aiak_overlap_ok = False
    #: With ``op=Average``: the part of the division by the set size done before the sum.
    gradient_predivide_factor = 1.0
    #: The user's optimizer class; set on each class :func:`wrap` makes.
    _aiak_wrapped_class: type = torch.optim.Optimizer

    def __init__(self, params: Any, named_parameters: Optional[NamedParameters],
                 backward_passes_per_step: int, op: int,
                 process_set: ProcessSet = global_process_set):
        # The wrapped class's __init__ with its default arguments; wrap() restores the
        # user's ``defaults`` afterwards.
        super().__init__(params)
        named = sorted(self._checked_names(named_parameters), key=lambda pair: pair[0])
        self._parameter_names = {p: name for name, p in named}
        # Counts down the passes still to accumulate before a parameter's gradient is sent.
        self._passes = BackwardPasses((p for _, p in named), backward_passes_per_step)
        self.op = op
        self.process_set = process_set
        # _synchronized: synchronize() ran since the last step(); _should_synchronize: False
        # inside skip_synchronize().
        self._should_synchronize = True
        self._synchronized = False
        # In-flight work per parameter (or tuple of parameters): (handle or None, context).
        self._handles: Dict[Any, Tuple[Any, Any]] = {}
        self._grad_accs: List[Any] = []
        self._requires_update: set = set()
        self._overlap = None

    # ---- names ----------------------------------------------------------------------------
    def _checked_names(self, named_parameters: Optional[NamedParameters]
                       ) -> List[Tuple[str, torch.Tensor]]:
        """``named_parameters`` as a list, validated as Horovod does; generated names when it
        is None (they only label the reductions, and are the same on every rank)."""
        if named_parameters is None:
            pairs = [(f"allreduce.noname.{gi}.{pi}", p)
                     for gi, group in enumerate(self.param_groups)
                     for pi, p in enumerate(group["params"])]
        else:
            pairs = list(named_parameters)
        if not all(isinstance(pair, tuple) for pair in pairs):
            raise ValueError(hs.NAMED_PARAMETERS_NOT_TUPLES)
        repeated = find_duplicates(name for name, _ in pairs)
        if repeated:
            raise ValueError(hs.NAMED_PARAMETERS_DUPLICATES.format(", ".join(repeated)))
        every_id = {id(p) for group in self.param_groups for p in group["params"]}
        nameless = every_id - {id(p) for _, p in pairs}
        if nameless:
            raise ValueError(hs.NAMED_PARAMETERS_INCOMPLETE.format(
                ", ".join(map(str, nameless))))
        return pairs

    def _trainable(self) -> List[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    # ---- the wrapped optimizer ---------------------------------------------------------------
    def _wrapped_step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The user's optimizer's own ``step()`` on the current param groups."""
        return super(DistributedWrapper, self).step(closure)

    def _step_only(self, params: Sequence[torch.Tensor]) -> None:
        """The wrapped ``step()`` on ``params`` alone."""
        with restricted_groups(self.param_groups, params):
            self._wrapped_step()

    def _scale_factors(self) -> Tuple[float, float]:
        """(prescale, postscale) for a gradient reduction.  For Average the engine divides by
        the set size after the sum itself; the predivide factor moves part of that division
        before the sum (keeps half-precision sums in range)."""
        if self.op != Average:
            return 1.0, 1.0
        return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor

    # ---- hooks and passes --------------------------------------------------------------------
    def _attach_hook(self, p: torch.Tensor) -> Any:
        """Run ``_make_hook(p)`` whenever ``p``'s gradient has been accumulated; returns what
        keeps the hook registered."""
        hook = self._make_hook(p)
        if hasattr(p, "register_post_accumulate_grad_hook"):
            return p.register_post_accumulate_grad_hook(hook)
        # torch < 2.1: hook the AccumulateGrad node that feeds p.grad.
        accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
        accumulator.register_hook(lambda *_: hook(p))
        return accumulator

    def _make_hook(self, p: torch.Tensor) -> Callable[..., None]:
        def hook(*_unused):
            self._gradient_ready(p)
        return hook

    def _gradient_ready(self, p: torch.Tensor) -> None:
        raise NotImplementedError  # each strategy says what a ready gradient starts

    def _count_pass(self, p: torch.Tensor) -> bool:
        """Record one backward pass of ``p``; True when it was the last one to accumulate.
        Horovod's error for a pass too many once ``p``'s reduction has started."""
        entry = self._handles.get(p)
        return self._passes.count(p, refuse_extra=entry is not None and entry[0] is not None)

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated per step (set: counted from the next re-arm on)."""
        return self._passes.per_step

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self._passes.per_step = passes

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated per step; restarts the count."""
        self._passes.rearm_all(passes)

    def reduction_view(self) -> ReductionView:
        """What the overlapped update (``overlap.py``) reads of this strategy."""
        return ReductionView(self)

    def _synchronize_for_step(self) -> None:
        """step()'s synchronize(), unless the script already called it and is inside
        ``skip_synchronize()``."""
        if not self._should_synchronize:
            self._synchronized = False
            return
        if self._synchronized:
            # Reducing the already averaged gradients again costs a full round of traffic.
            warnings.warn(hs.STEP_AFTER_SYNCHRONIZE)
        self.synchronize()
        self._synchronized = False

    def _carry_state(self, state: Dict[torch.Tensor, Dict[str, Any]]) -> None:
        """Adopt the state the optimizer had before it was wrapped (Horovod drops it)."""
        for p, s in state.items():
            self.state[p] = s

    # ---- public methods every strategy shares ----------------------------------------------
    def overlap_stats(self) -> dict:
        """Counters of the overlapped update (``overlap_update``): steps overlapped and fallen
        back (by reason), buckets, parameter updates, and the update time hidden behind
        communication.  Empty when overlap is off."""
        return {} if self._overlap is None else self._overlap.stats.as_dict()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` use the gradients as they are, without synchronizing, inside this
        block: for when ``synchronize()`` already ran, e.g. to clip the averaged gradients::

            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()

        Blocks do not nest: leaving any of them turns synchronization back on.
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def zero_grad(self, *args, **kwargs):
        # Clearing a gradient the engine is still reducing in place would race with it.
        if self._handles:
            raise AssertionError(hs.ZERO_GRAD_RACE)
        return super().zero_grad(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        # Work still in flight belongs to the state being replaced: forget it.
        self._handles = {}
        self._passes.rearm_all()
        self._should_synchronize, self._synchronized = True, False
        super().load_state_dict(*args, **kwargs)


def wrap(optimizer: torch.optim.Optimizer, strategy: type, *args: Any, **kwargs: Any
         ) -> torch.optim.Optimizer:
    """``optimizer`` wrapped by ``strategy`` (a :class:`DistributedWrapper` subclass), whose
    ``__init__`` receives the param groups, then ``args``/``kwargs``.

    The result is an instance of a subclass of ``type(optimizer)`` with the same name, sharing
    its param groups; its state is carried over (Horovod drops it) and its ``defaults`` are
    the user's, not the defaults of the class's ``__init__``.
    """
    if not issubclass(strategy, DistributedWrapper):
        raise TypeError(f"{strategy!r} is not a DistributedWrapper strategy")
    base = type(optimizer)
    if issubclass(base, DistributedWrapper):
        raise ValueError(f"This {base.__name__} is already a DistributedOptimizer; wrap the "
                         "original optimizer once.")
    cls = type(base.__name__, (strategy, base),
               {"__module__": strategy.__module__, "__doc__": base.__doc__,
                "_aiak_wrapped_class": base})
    wrapped = cls(optimizer.param_groups, *args, **kwargs)
    wrapped._carry_state(optimizer.state)
    # Apex-style optimizers read options from ``defaults`` at step time (FusedLAMB's
    # max_grad_norm), and add_param_group() fills new groups from it.
    wrapped.defaults.update(optimizer.defaults)
    return wrapped
