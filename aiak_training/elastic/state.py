"""Elastic state objects: what survives a reset, and how it is saved, restored and synced.

Semantics follow Horovod 0.28.1's ``horovod.common.elastic``:

* ``commit()`` = ``save()`` then ``check_host_updates()``;
* ``check_host_updates()`` drains the host-change notifications this process received,
  agrees on them with rank 0 (one ``broadcast_object``) and raises
  :class:`HostsUpdatedInterrupt` on every rank at the same commit;
* ``on_reset()`` runs after the world was re-formed: ``reset()``, then the user's callbacks.

One deliberate difference in :class:`ObjectState`: the committed values are kept as pickles,
not as references.  Horovod keeps a reference, so a list mutated in place after a commit is
"restored" with the mutation; here ``restore()`` gives back exactly what was committed, and
an attribute that cannot be pickled fails at ``commit()`` with its name, instead of much
later in ``sync()`` on another rank.
"""
from __future__ import annotations

import enum
import queue
from typing import Any, Callable, Dict, Iterable, List, Tuple

import cloudpickle

from aiak_training.common.exceptions import HostsUpdatedInterrupt


class HostUpdateResult(enum.IntFlag):
    """What a host change did (Horovod's ``horovod.runner.elastic.discovery`` flags)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class Restorable:
    """Something that keeps a committed copy of its values: ``save`` keeps the current values,
    ``restore`` goes back to them, ``sync`` makes every rank hold rank 0's, ``reset`` adapts
    to a new world.  Elastic states are, and so are the per-object handlers of framework
    states."""

    def save(self) -> None:
        """Keep the current values as the committed ones."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Go back to the values of the last ``save``."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Make every rank hold rank 0's values."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Adapt to a new world (nothing by default)."""


class State(Restorable):
    """Base class of elastic state.  Subclasses implement ``save``, ``restore`` and ``sync``.

    ``bcast_object(obj)`` must return rank 0's ``obj`` on every rank; ``get_rank()`` returns
    this process's rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: "queue.Queue[Tuple[int, int]]" = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called, in order, after every reset (e.g. to rescale the learning rate
        to the new ``size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``run`` once the ranks were re-formed: drop stale notifications, reset
        the state's objects to the new world, then run the reset callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """A host change notification (from the driver): checked at the next commit."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state as the point to come back to, then check for host changes."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when hosts changed since the
        last check.  Collective: every rank must call it (``commit`` does)."""
        from aiak_training.elastic.worker import notification_manager
        notification_manager.poll()
        last = prev = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= HostUpdateResult(result)
        # Rank 0's view decides, so that all ranks raise (or not) at the same commit.
        prev, self._last_updated_timestamp, update = self._bcast_object(
            (prev, last, int(update)))
        if self._last_updated_timestamp > prev:
            # Only removals: the survivors all hold the state just committed, no sync needed.
            raise HostsUpdatedInterrupt(HostUpdateResult(update) == HostUpdateResult.removed)

    def reset(self) -> None:
        """Adapt the state's objects to a new world (before the reset callbacks run)."""


def _pickled(name: str, value: Any) -> bytes:
    try:
        return cloudpickle.dumps(value)
    except Exception as exc:  # pickling raises TypeError, PicklingError, AttributeError...
        raise TypeError(f"elastic state attribute {name!r} cannot be pickled, so it cannot "
                        f"be committed or sent to new ranks ({type(value).__name__}: "
                        f"{exc})") from exc


class ObjectState(State):
    """State made of picklable attributes given as keyword arguments: ``state.epoch`` etc.

    ``sync`` broadcasts the committed values from rank 0.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any):
        self._bcast_object = bcast_object
        self._saved_state: Dict[str, bytes] = {}
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved_state = {name: _pickled(name, value) for name, value in kwargs.items()}
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        # Pickle everything first, so a failure leaves the previous commit untouched.
        self._saved_state = {name: _pickled(name, getattr(self, name))
                             for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, data in self._saved_state.items():
            setattr(self, name, cloudpickle.loads(data))


class VariablesState(ObjectState):
    """Framework variables (anything with ``numpy()`` and ``assign()``) plus picklable
    attributes: the variables are copied at each commit and broadcast from rank 0 at sync.
    ``variables()`` lists them (it may build missing ones, e.g. a fresh optimizer's slots);
    ``broadcast(variables)`` overwrites them with rank 0's values on every rank."""

    def __init__(self, variables: Callable[[], List[Any]],
                 broadcast: Callable[[List[Any]], None], bcast_object: Callable[[Any], Any],
                 get_rank: Callable[[], int], **kwargs: Any):
        self._list_variables = variables
        self._broadcast_variables = broadcast
        self._save_variables()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank, **kwargs)

    def _save_variables(self) -> None:
        import numpy as np
        self._saved_values = [np.array(v.numpy(), copy=True) for v in self._list_variables()]

    def save(self) -> None:
        super().save()
        self._save_variables()

    def restore(self) -> None:
        for variable, value in zip(self._list_variables(), self._saved_values):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        variables = self._list_variables()
        if variables:
            self._broadcast_variables(variables)
        self._save_variables()
        super().sync()
