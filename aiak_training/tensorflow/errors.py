"""Engine failures as TensorFlow errors.

Horovod's TensorFlow ops fail through TensorFlow's status codes: a mismatch between ranks is
``tf.errors.FailedPreconditionError``, a stopped job ``tf.errors.UnknownError``.  Eager calls
here raise classes that are both that TensorFlow error and :class:`HorovodInternalError`,
so either ``except`` clause catches them.  Inside a graph the op fails with the same
TensorFlow class (see ``_status_op``), its message carrying ours.

Bad arguments that only show when the op runs (an alltoall whose rows do not divide among
the ranks, a collective on a process set this rank is not in) are
``tf.errors.InvalidArgumentError``, as in Horovod; eagerly they are also ``ValueError``.
"""
import tensorflow as tf

from aiak_training.common.exceptions import HorovodInternalError

# How the coordinator's negotiation errors begin (csrc/engine/controller.cpp): the ranks
# submitted the same name with different requests, or an op that joined ranks cannot do.
_NEGOTIATION_ERRORS = ("Mismatched ", "Tensor ")


class HorovodPreconditionError(HorovodInternalError, tf.errors.FailedPreconditionError):
    """The ranks disagreed about an operation (shape, type, op, root, ...)."""

    def __init__(self, message: str):
        HorovodInternalError.__init__(self, message)
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class HorovodUnknownError(HorovodInternalError, tf.errors.UnknownError):
    """The job stopped (a rank failed or shut down) while the operation was pending."""

    def __init__(self, message: str):
        HorovodInternalError.__init__(self, message)
        tf.errors.UnknownError.__init__(self, None, None, message)


def framework_error(exc: HorovodInternalError) -> HorovodInternalError:
    """``exc`` as the TensorFlow-flavoured error Horovod would have raised."""
    message = str(exc)
    if message.startswith(_NEGOTIATION_ERRORS):
        return HorovodPreconditionError(message)
    return HorovodUnknownError(message)


class HorovodInvalidArgumentError(ValueError, tf.errors.InvalidArgumentError):
    """An argument the operation cannot run with (found when it runs)."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def invalid_argument(exc: ValueError) -> ValueError:
    """``exc`` as the ``tf.errors.InvalidArgumentError`` Horovod's op would raise."""
    if isinstance(exc, tf.errors.InvalidArgumentError):
        return exc
    return HorovodInvalidArgumentError(str(exc))
