"""Exception types.  The class names are Horovod's, so ``except hvd.HorovodInternalError``
in user code keeps working."""

from aiak_training.common import exit_guard as _exit_guard


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank: a peer died or disagreed, or the job was stopped.

    Every pending and later operation raises it until the job is restarted (elastic training
    treats it as the signal to reset).
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        # After a failed collective, this process's exit must not wait on MPI_Finalize for a
        # peer that may never come (see common/exit_guard.py).
        _exit_guard.note_failure(str(args[0]) if args else "")


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added to or removed from an elastic job (raised by ``state.commit()``).
    ``skip_sync`` is True when hosts were only removed: the survivors all hold the state
    just committed, so it need not be synchronized again (new hosts need it)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__()
        self.skip_sync = skip_sync
