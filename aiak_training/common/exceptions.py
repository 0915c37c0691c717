"""Exception types.  The class names are Horovod's, so ``except hvd.HorovodInternalError``
in user code keeps working."""


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank: a peer died or disagreed, or the job was stopped.

    Every pending and later operation raises it until the job is restarted (elastic training
    treats it as the signal to reset).
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added to or removed from an elastic job; ``skip_sync`` is True when only
    additions happened, so state need not be synchronized again."""

    def __init__(self, skip_sync: bool = False):
        super().__init__()
        self.skip_sync = skip_sync
