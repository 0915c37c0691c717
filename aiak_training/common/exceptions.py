"""Exception types.  The class names are Horovod's, so ``except hvd.HorovodInternalError``
in user code keeps working."""

from aiak_training.common.job import exit_guard as _exit_guard


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank: a peer died or disagreed, or the job was stopped.

    Every pending and later operation raises it until the job is restarted (elastic training
    treats it as the signal to reset).
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        # After a failed collective, this process's exit must not wait on MPI_Finalize for a
        # peer that may never come (see common/job/exit_guard.py).
        _exit_guard.note_failure(str(args[0]) if args else "")


#: How the engine's deadlock error begins (csrc/engine/controller.cpp, deadlock_message).
DEADLOCK_PREFIX = "deadlock: "


class DeadlockError(HorovodInternalError):
    """Every rank waited for a collective that some ranks never submitted, so none could go
    on (the engine's deadlock check; the message names what each rank waited for).

    A bug in the program, not a lost peer: an elastic job does not restore and retry it, as
    the retry would stop the same way.
    """


def collective_error(message: str) -> HorovodInternalError:
    """The exception for a failed collective whose engine reported ``message``."""
    if message.startswith(DEADLOCK_PREFIX):
        return DeadlockError(message)
    return HorovodInternalError(message)


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added to or removed from an elastic job (raised by ``state.commit()``).
    ``skip_sync`` is True when hosts were only removed: the survivors all hold the state
    just committed, so it need not be synchronized again (new hosts need it)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__()
        self.skip_sync = skip_sync
