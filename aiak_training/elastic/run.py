"""``hvd.elastic.run``: re-run a training function from its last commit after a reset."""
from __future__ import annotations

import functools
from typing import Any, Callable

from aiak_training.common.exceptions import (DeadlockError, HorovodInternalError,
                                             HostsUpdatedInterrupt)
from aiak_training.elastic.worker import elastic_enabled, notification_manager


def elastic_mode() -> bool:
    """Whether this process runs under the elastic driver (``aiakrun --host-discovery-script``
    or ``--min-np``)."""
    return elastic_enabled()


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wrap ``func(state, *args, **kwargs)`` so that it survives resets.

    * ``HorovodInternalError`` (a peer died): restore the last commit, ``reset()`` (re-form
      the world), ``state.on_reset()``, sync from the new rank 0 and call ``func`` again;
      but not its ``DeadlockError``, which ends the job (a retry would deadlock again);
    * ``HostsUpdatedInterrupt`` (hosts added or removed, raised at a commit): the same without
      the restore (the state was just committed), and without the sync when hosts were only
      removed.

    Without elastic mode ``func`` runs once after ``state.sync()``, as in Horovod.
    """
    @functools.wraps(func)
    def wrapper(state, *args: Any, **kwargs: Any) -> Any:
        if not elastic_mode():
            state.sync()
            return func(state, *args, **kwargs)
        notification_manager.init()
        notification_manager.register_listener(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except DeadlockError:
                    raise  # a bug of the program: a retry would stop the same way
                except HorovodInternalError:
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as exc:
                    skip_sync = exc.skip_sync
                reset()
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)
    return wrapper
