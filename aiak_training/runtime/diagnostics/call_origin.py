"""Which of the library's collective helpers submitted a collective.

``consolidate_state_dict()``, ``broadcast_object()`` and the like submit collectives under
names of their own (``allgather.allgather_object.sharded.state_keys``).  Called on some
ranks only, they leave the others waiting, and a report that shows only the tensor name
does not tell the user which call of theirs is at fault.  A helper decorated with
:func:`collective_helper` names itself to the engine for the time of the call; the
engine's stall warnings and deadlock errors then say which helper submitted what, and that
it must be called on every rank.  The outermost helper wins: ``consolidate_state_dict``
calls ``allgather_object``, and the user called the former.
"""
import functools
from typing import Callable, TypeVar

from aiak_training.common import native

F = TypeVar("F", bound=Callable)


def collective_helper(name: str) -> Callable[[F], F]:
    """Decorate a public helper that runs collectives: every rank must call it."""
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if native.call_origin():  # an outer helper named the call already
                return fn(*args, **kwargs)
            native.set_call_origin(name)
            try:
                return fn(*args, **kwargs)
            finally:
                native.set_call_origin("")
        return call  # type: ignore[return-value]
    return decorate
