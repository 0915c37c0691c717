"""Launch plans: a param group's kernel argument tables, built once and reused every step.

Each step hands the kernels, per parameter, the addresses of the param, its gradient and its
states, plus element counts and a dtype code.  Gathering those with per-parameter Python
(state lookups, layout checks, one list per table) costs more host time than a GPU needs
for the update itself when a model has many small tensors (ResNet-50: 161).  A plan keeps the
tables (int lists for the CPU module, ctypes arrays for the CUDA library).  Each step it
checks that they still describe the group with C-level passes only (``map`` over
``attrgetter``/``Tensor.data_ptr`` and list comparisons, no Python bytecode per parameter):

* the group holds the same parameter objects in the same order (the cache key), and the
  same ones have a gradient;
* every parameter and state tensor (step counter and master copy included) is at the same
  address, and the optimizer state holds the same per-parameter dicts.  A ``param.data = ...``
  swap, a dtype change, ``load_state_dict``, state entries added, removed or replaced, or a
  state tensor replaced by hand all fail this, and the plan is then built again from scratch;
* gradients: ``zero_grad(set_to_none=True)`` makes new gradient tensors every step.  When
  their addresses moved, the new gradients must have the parameters' strides and dtypes, and
  only the gradient tables are rebuilt;
* the group options that decide which tables exist (``Plan.flags``, e.g. amsgrad), and the
  optimizer's ``state`` object itself.

Hyper-parameters (lr, betas, weight decay, ...), GradScaler's ``grad_scale``/``found_inf`` and
the CUDA stream are read at every step, so LR schedulers need no invalidation.  A plan does not
hold the tensors: addresses and the parameters' ``id`` values are enough, since a tensor freed
and replaced at the same address is exactly what the kernels need to see.
"""
from __future__ import annotations

import ctypes
import operator
from itertools import compress, repeat
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from . import _backend as B

_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride

# Plans kept per optimizer: one per param group, plus one per bucket when buckets are stepped
# on their own (overlapped updates).  Past the limit the cache starts over.
PLAN_LIMIT = 256


def _ptrs(tensors: Sequence[torch.Tensor]) -> List[int]:
    return list(map(_PTR, tensors))


def pick(values: List[Any], ids: Optional[List[int]]) -> List[Any]:
    """values at positions ids (all of them when ids is None), without a Python loop."""
    return values if ids is None else list(map(values.__getitem__, ids))


class Bucket:
    """The tables of one kernel call: the plan positions of one (dtype, master weights) pair."""

    __slots__ = ("ids", "dtype", "dtype_code", "numels", "c_numels", "tables", "arrays")

    def __init__(self, ids: Optional[List[int]], dtype: torch.dtype, numels: List[int]) -> None:
        self.ids = ids  # None: every position, in order
        self.dtype = dtype
        self.dtype_code = B.DTYPE_CODES[dtype]
        self.numels = numels
        self.c_numels = B.int64_array(numels)
        self.tables: Dict[str, List[int]] = {}              # CPU: slot -> addresses
        self.arrays: Dict[str, Optional[ctypes.Array]] = {}  # CUDA: slot -> pointer array


class Plan:
    """The tables of one kernel-ready set of positions on one device; see the module doc.

    ``slots`` maps a table name to a list with one tensor (or None) per position, besides the
    ``params`` and ``grads`` tables; ``master_slot`` names the table of fp32 master copies (a
    kernel call takes one dtype, with or without masters).  A plan that is cached also gets
    ``state_keys`` (table name -> optimizer state key), its cache key, flags, the optimizer's
    state and the group's params, which :meth:`refresh` checks; the functional API builds
    throwaway plans without them.
    """

    def __init__(self, params: List[torch.Tensor], grads: List[torch.Tensor],
                 slots: Dict[str, List[Optional[torch.Tensor]]], *, master_slot: Optional[str] = None,
                 state_keys: Optional[Dict[str, str]] = None, key: Hashable = None,
                 flags: Tuple = (), state: Any = None,
                 group_params: Optional[Sequence[torch.Tensor]] = None) -> None:
        self.key = key
        self.flags = flags
        self.state = state
        # The per-parameter state dicts, held so that the step needs no lookup by tensor (a
        # tensor's __hash__ is Python code), and the identity of every dict in the state.
        self.state_dicts = [] if state is None else [state.get(p) for p in params]
        self.state_ids = [] if state is None else list(map(id, state.values()))
        self.cuda = uses_cuda_tables(params[0].device)
        self.device = params[0].device
        # Which of the group's params have a gradient (only for plans that are cached).
        self.mask = ([] if group_params is None else
                     list(map(operator.is_not, map(_GRAD, group_params), repeat(None))))
        self.all_have_grads = all(self.mask)
        self.param_ptrs = _ptrs(params)
        self.strides = list(map(_STRIDE, params))
        self.dtypes = list(map(_DTYPE, params))
        self.grad_ptrs = _ptrs(grads)
        # Per state table: its state key, the positions holding it (None: all) and addresses.
        self.checks: List[Tuple[str, Optional[List[int]], List[int]]] = []
        for name, key_ in (state_keys or {}).items():
            tensors = slots[name]
            where = [i for i, t in enumerate(tensors) if t is not None]
            ids = None if len(where) == len(tensors) else where
            if not where:
                continue
            self.checks.append((key_, ids, _ptrs(pick(tensors, ids))))
        full: Dict[str, List[int]] = {"params": self.param_ptrs, "grads": self.grad_ptrs}
        for name, tensors in slots.items():
            full[name] = [0 if t is None else t.data_ptr() for t in tensors]
        masters = slots.get(master_slot) if master_slot else None
        self.buckets: List[Bucket] = []
        n = len(params)
        for (dtype, has_master), ids in B.kernel_buckets(
                params, masters if masters is not None else [None] * n, range(n)).items():
            ids_or_all = None if len(ids) == n else ids
            bucket = Bucket(ids_or_all, dtype, [params[i].numel() for i in ids])
            for name, addrs in full.items():
                sub = pick(addrs, ids_or_all)
                if name == master_slot and not has_master:
                    sub = []
                self._set(bucket, name, sub)
            self.buckets.append(bucket)

    def _set(self, bucket: Bucket, name: str, addrs: List[int]) -> None:
        if self.cuda:
            bucket.arrays[name] = (ctypes.c_void_p * len(addrs))(*addrs) if addrs else None
        else:
            bucket.tables[name] = addrs

    def refresh(self, group_params: Sequence[torch.Tensor], state: Any, flags: Tuple) -> bool:
        """Whether the plan still describes the group; updates the gradient tables."""
        if (state is not self.state or flags != self.flags
                or list(map(id, state.values())) != self.state_ids):
            return False
        grads = list(map(_GRAD, group_params))
        if self.all_have_grads:
            if not all(map(operator.is_not, grads, repeat(None))):
                return False
            params = group_params
        else:
            if list(map(operator.is_not, grads, repeat(None))) != self.mask:
                return False
            grads = list(compress(grads, self.mask))
            params = list(compress(group_params, self.mask))
        try:
            if _ptrs(params) != self.param_ptrs:
                return False
            states = self.state_dicts
            for key, ids, addrs in self.checks:
                if _ptrs(list(map(operator.itemgetter(key), pick(states, ids)))) != addrs:
                    return False
            grad_ptrs = _ptrs(grads)
        except (KeyError, TypeError, RuntimeError):  # a state entry gone, a sparse gradient
            return False
        if grad_ptrs != self.grad_ptrs:
            # New gradient tensors: the kernels walk them as flat arrays like their params.
            if list(map(_STRIDE, grads)) != self.strides or list(map(_DTYPE, grads)) != self.dtypes:
                return False
            self.grad_ptrs = grad_ptrs
            for bucket in self.buckets:
                self._set(bucket, "grads", pick(grad_ptrs, bucket.ids))
        return True


class PlanCache:
    """An optimizer's plans, keyed by param-group index and the ids of the group's params."""

    def __init__(self) -> None:
        self._plans: Dict[Hashable, Plan] = {}
        self._state: Any = None

    def lookup(self, index: int, group_params: Sequence[torch.Tensor], state: Any,
               flags: Tuple) -> Tuple[Optional[Plan], Hashable]:
        """The valid plan for this group, or None, and the key to store a new one under."""
        if state is not self._state:  # load_state_dict: every plan describes old tensors
            self._plans.clear()
            self._state = state
        key = (index, tuple(map(id, group_params)))
        plan = self._plans.get(key)
        if plan is not None and not plan.refresh(group_params, state, flags):
            del self._plans[key]
            plan = None
        return plan, key

    def store(self, plan: Plan) -> None:
        if len(self._plans) >= PLAN_LIMIT:
            self._plans.clear()
        self._plans[plan.key] = plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def plans_of(optimizer: Any) -> PlanCache:
    """The optimizer's plan cache, created on first use.  It is not part of the pickled or
    copied optimizer (torch's ``__getstate__`` keeps defaults, state and param_groups only)."""
    cache = optimizer.__dict__.get("_aiak_plans")
    if cache is None:
        cache = PlanCache()
        optimizer.__dict__["_aiak_plans"] = cache
    return cache


def uses_cuda_tables(device: torch.device) -> bool:
    """Whether plans for ``device`` hold ctypes arrays for the CUDA library (a function so that
    tests can drive the CUDA branch with CPU tensors and a fake library)."""
    return device.type == "cuda"


def kernels_ready(device: torch.device) -> bool:
    """Whether the compiled kernels can run for tensors on ``device`` (no warning here: the
    unplanned path warns when it falls back)."""
    if device.type == "cpu":
        return B.cpu_ext is not None
    return device.type == "cuda" and B.cuda_kernels_usable(device)


def plannable(device: torch.device, per_position: Sequence[List[torch.Tensor]]) -> bool:
    """A plan can cover these positions: kernels available, and every position's tensors walk
    as flat arrays (built once per layout, so per-parameter Python is fine here)."""
    return bool(per_position) and kernels_ready(device) and all(
        B.kernel_friendly(ts) for ts in per_position)
