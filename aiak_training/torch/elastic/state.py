"""``TorchState``: a model, an optimizer, samplers and any picklable attributes as one
elastic state."""
from __future__ import annotations

import copy
from typing import Any, Dict, Tuple

import torch

from aiak_training.elastic import ObjectState
from aiak_training.elastic.state import Restorable
from aiak_training.torch.elastic.sampler import ElasticSampler


class _Handler(Restorable):
    """Saves, restores and syncs one object that pickling would not handle well: by a deep
    copy of its ``state_dict`` (models, optimizers and samplers all have one)."""

    def __init__(self, value: Any):
        self.value = value
        self.save()

    def set_value(self, value: Any) -> None:
        _handler_for(value)  # refuses what TorchState cannot track, as at construction
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)


class _ModelHandler(_Handler):
    def sync(self) -> None:
        from aiak_training.torch.functions import broadcast_parameters
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        from aiak_training.torch.functions import broadcast_optimizer_state
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def merge(self) -> None:
        """Collective, at each commit: add the samples every rank processed since the last
        commit to the processed set, so that the commit holds the whole epoch's progress
        (Horovod keeps each rank's own part and repeats a dead rank's samples)."""
        from aiak_training.torch.functions import allgather_object
        for part in allgather_object(self.value.take_unmerged(),
                                     name="elastic.sampler.recorded"):
            self.value.processed_indices.update(part)

    def sync(self) -> None:
        from aiak_training.torch.functions import broadcast_object
        # Rank 0's committed progress is already merged over all ranks (see merge); the
        # samples others recorded after that commit were not committed and are redone.
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0,
                                                    name="elastic.sampler.state"))

    def reset(self) -> None:
        self.value.reset()


SHARDED_REFUSED = (
    "hvd.elastic.TorchState does not accept an optimizer built with "
    "shard_optimizer_state=True: each rank holds the only copy of its shard of the optimizer "
    "state, so a lost rank could not be recovered. Use a DistributedOptimizer without "
    "shard_optimizer_state in elastic jobs.")


def _handler_for(value: Any):
    if isinstance(value, torch.nn.Module):
        return _ModelHandler
    if isinstance(value, torch.optim.Optimizer):
        if getattr(value, "_aiak_sharded", False):
            # A lost rank would take the only copy of its shard of the optimizer state.
            raise ValueError(SHARDED_REFUSED)
        return _OptimizerHandler
    if isinstance(value, ElasticSampler):
        return _SamplerHandler
    return None


def _split_handlers(kwargs: Dict[str, Any]) -> Tuple[Dict[str, _Handler], Dict[str, Any]]:
    handlers, rest = {}, {}
    for name, value in kwargs.items():
        cls = _handler_for(value)
        if cls is None:
            rest[name] = value
        else:
            handlers[name] = cls(value)
    return handlers, rest


class TorchState(ObjectState):
    """Horovod's ``hvd.elastic.TorchState(model=None, optimizer=None, **kwargs)``.

    Models and optimizers are saved as deep copies of their ``state_dict`` and synced with
    ``broadcast_parameters`` / ``broadcast_optimizer_state``; ``ElasticSampler`` arguments
    merge their progress at each sync; other keyword arguments are picklable attributes
    (``state.epoch``, ``state.batch``...) broadcast from rank 0.  Assigning a new model or
    optimizer to the attribute (``state.model = m``) replaces what is tracked.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any):
        from aiak_training.torch.functions import broadcast_object
        from aiak_training.torch.mpi_ops import rank
        kwargs.update(model=model, optimizer=optimizer)
        handlers, rest = _split_handlers(kwargs)
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=lambda obj: broadcast_object(
            obj, root_rank=0, name="elastic.state"), get_rank=rank, **rest)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        # The collective part first: if a peer dies here, nothing of this commit is kept,
        # so the previous commit stays whole (model, optimizer, sampler and attributes
        # always come from the same commit).
        for handler in self._handlers.values():
            if isinstance(handler, _SamplerHandler):
                handler.merge()
        super().save()  # then the attributes: one that cannot be pickled stops here
        for handler in self._handlers.values():
            handler.save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
