"""Engine failures as TensorFlow errors.

Horovod's TensorFlow ops fail through TensorFlow's status codes: a mismatch between ranks is
``tf.errors.FailedPreconditionError``, a stopped job ``tf.errors.UnknownError``.  Eager calls
here raise classes that are both that TensorFlow error and :class:`HorovodInternalError`,
so either ``except`` clause catches them.  Inside a graph the op fails with the same
TensorFlow class (see below), its message carrying ours.

Bad arguments that only show when the op runs (an alltoall whose rows do not divide among
the ranks, a collective on a process set this rank is not in) are
``tf.errors.InvalidArgumentError``, as in Horovod; eagerly they are also ``ValueError``.

The ``AiakCheckStatus`` op (``_status_op.cc``, :func:`status_op_module`) is how a graph
collective fails with ``tf.errors.FailedPreconditionError`` as Horovod's C++ ops do.
TensorFlow turns any Python exception of a ``tf.py_function`` into ``UnknownError``
(``ValueError`` into ``InvalidArgumentError``); only a C++ kernel can set another status.
This one kernel is compiled on first use against the TensorFlow of the process (its
headers and flags come with the wheel; a C++17 compiler is needed, ``CXX`` or ``g++``),
once per TensorFlow version and source, into a cache shared by all processes of a user
(``AIAK_TF_OP_CACHE``, default ``~/.cache/aiak_training/tf_ops``).  Where it cannot be
built the collectives still fail, as ``UnknownError`` carrying the same message, and a
warning says why once.
"""
import fcntl
import hashlib
import logging
import os
import subprocess
import threading
from types import ModuleType
from typing import Optional

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


# ---- the status op of graph collectives ------------------------------------------------------
log = logging.getLogger("aiak_training")

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_status_op.cc")
_lock = threading.Lock()
_loaded: Optional[ModuleType] = None
_tried = False


def _cache_dir() -> str:
    return os.environ.get("AIAK_TF_OP_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "aiak_training", "tf_ops")


def _build(target: str, flags: list) -> None:
    """Compile the kernel into ``target`` (atomically: other processes see it whole)."""
    compiler = os.environ.get("CXX", "g++")
    partial = f"{target}.{os.getpid()}.tmp"
    cmd = [compiler, "-shared", "-fPIC", "-O2", "-w", _SOURCE, "-o", partial] + flags
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}")
    os.replace(partial, target)


def _load() -> ModuleType:
    flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    with open(_SOURCE, "rb") as source:
        key = hashlib.sha256(source.read() + tf.__version__.encode() +
                             " ".join(flags).encode()).hexdigest()[:16]
    directory = _cache_dir()
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, f"aiak_check_status_{key}.so")
    if not os.path.exists(target):
        # Ranks of one job start together: one compiles, the others wait for its result.
        with open(os.path.join(directory, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not os.path.exists(target):
                    _build(target, flags)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return tf.load_op_library(target)


@tf.autograph.experimental.do_not_convert  # first called while a tf.function is traced
def status_op_module() -> Optional[ModuleType]:
    """The loaded op library (built on the first call), or None where it cannot be built."""
    global _loaded, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _load()
            except Exception as exc:  # noqa: BLE001 - a missing compiler must not stop training
                log.warning("aiak_training: graph collectives will report failures between "
                            "ranks as tf.errors.UnknownError, not FailedPreconditionError: "
                            "the status op could not be built (%s).", exc)
        return _loaded
