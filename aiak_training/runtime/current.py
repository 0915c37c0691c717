"""The engine of this process: set by ``init``, cleared by ``shutdown``, read by everything
that submits work or asks about the job's layout."""
from typing import TYPE_CHECKING, Optional

from aiak_training.common import horovod_strings as hs
from aiak_training.common.topology import Topology

if TYPE_CHECKING:  # for annotations only: the engine module needs nothing from here
    from aiak_training.runtime.engine import Engine

_engine: Optional["Engine"] = None


def install(engine: Optional["Engine"]) -> Optional["Engine"]:
    """Make ``engine`` the current one (None clears it); return the previous one.  Callers
    serialize installs (``basics.init`` and ``basics.shutdown`` hold a lock)."""
    global _engine
    previous, _engine = _engine, engine
    return previous


def is_initialized() -> bool:
    """Whether ``init`` has run and the runtime is still up."""
    current = _engine
    return current is not None and current.running


def engine() -> "Engine":
    """The running engine; ``ValueError`` if ``init`` has not been called or the engine has
    stopped."""
    current = _engine
    if current is None or not current.running:
        if current is not None:
            # Still installed, yet stopped: not by shutdown() (which uninstalls it) but because
            # the job failed or another rank shut down.  Every later operation fails as the
            # pending ones did, as in Horovod, until shutdown() and init().
            from aiak_training.common.exceptions import HorovodInternalError
            raise HorovodInternalError(current.failure or hs.SHUT_DOWN)
        raise ValueError(hs.NOT_INITIALIZED)
    return current


def topology() -> Topology:
    """The layout of the initialized job.  It stays readable after a peer stopped the job,
    until this process calls ``shutdown``, so error handlers can still log their rank."""
    current = _engine
    if current is None or current.topology is None:
        raise ValueError(hs.NOT_INITIALIZED)
    return current.topology
