"""Checkpoints of the sharded strategy: its state carried over, loaded and consolidated.

``state_dict()`` never communicates.  It returns the full state gathered by the last
``consolidate_state_dict()`` (a collective: every rank calls it) and raises otherwise, so
that ``if hvd.rank() == 0: torch.save(opt.state_dict())`` can fail but never hang.
``load_state_dict`` takes a full (plain-optimizer format) state dict from any world size and
keeps this rank's slices.
"""
from __future__ import annotations

import collections
from typing import Any, Dict

import torch

from aiak_training.runtime.diagnostics.call_origin import collective_helper
from aiak_training.torch.mpi_ops import allgather_async, synchronize
from aiak_training.torch.optim.wrapper import DistributedWrapper

CONSOLIDATE_FIRST = (
    "state_dict() of an optimizer with shard_optimizer_state=True: each rank holds only its "
    "shard of the state. Call optimizer.consolidate_state_dict() on every rank first (a "
    "collective), then state_dict() on any rank, e.g. before "
    "`if hvd.rank() == 0: torch.save(...)`. The consolidated copy is dropped by the next step().")


def _per_element(key: str, value: Any, p: torch.Tensor) -> bool:
    """Whether state entry ``key`` holds one value per element of ``p`` (sliced with it)."""
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == p.shape


class Checkpoints:
    """The sharded strategy's state methods (a part of :class:`ShardedStrategy`, which
    supplies the fields)."""

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
                packed = torch.zeros(b.shard, dtype=dtype, device=b.storage.device)
                lo = b.mine.storage_offset()
                for _, _, _, piece in b.pieces:
                    value = self.state.get(piece, {}).get(key)
                    if value is not None:
                        start = piece.storage_offset() - lo
                        packed[start:start + piece.numel()].copy_(value)
                full = synchronize(allgather_async(packed, name=f"{b.name}.state.{key}",
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
