"""One line after a Keras 3 error in a Horovod script: how to get Keras 2.

A Horovod script that reaches Keras 3 through ``tf.keras`` fails in Keras 2 idioms, with
errors that do not mention Keras versions (``TypeError: 'list' object is not callable`` for
``opt.variables()``, ``unexpected keyword argument 'experimental_run_tf_function'``, ...).
The Horovod shim installs :func:`install`, a ``sys.excepthook`` that prints the usual
traceback and then, for such an error, one line saying how to install and enable Keras 2.
``aiakrun`` repeats that line after its summary (runner/report/launcher_output.py).
"""
from __future__ import annotations

import os
import re
import sys
import traceback
from types import TracebackType
from typing import Optional, Type

from aiak_training.compat.keras2 import LEGACY_ENV, tf_keras_installed

#: Start of the line; aiakrun looks for it in the ranks' output.
HINT_PREFIX = "aiak-training: hint: this Horovod script uses the Keras 2 API"

# Keras 2 idioms and how Keras 3 answers them.
_IDIOMS = (
    # optimizer.variables() -- a method in Keras 2, a list property in Keras 3.
    re.compile(r"\.variables\(\)[\s\S]*'list' object is not callable"
               r"|'list' object is not callable[\s\S]*\.variables\(\)"),
    re.compile(r"unexpected keyword argument 'experimental_run_tf_function'"),
    re.compile(r"keras\.optimizers\.legacy` is not supported in Keras 3"),
    re.compile(r"object has no attribute '(lr|get_updates|get_gradients|fit_generator|"
               r"evaluate_generator|predict_generator)'"),
)
_TRUE = ("1", "true", "yes")


def keras3_in_use() -> bool:
    """Whether this process's ``tf.keras`` is Keras 3."""
    keras = sys.modules.get("keras")
    if keras is None or not str(getattr(keras, "__version__", "")).startswith("3"):
        return False
    return os.environ.get(LEGACY_ENV, "").strip().lower() not in _TRUE


def is_keras2_idiom_error(text: str) -> bool:
    """Whether an error's text (message and failing source line) is one of Keras 3's
    answers to a Keras 2 idiom."""
    return any(p.search(text) for p in _IDIOMS)


def hint(tf_version: str, installed: bool) -> str:
    """The one line: install ``tf_keras`` (matching ``tf_version``) or enable it."""
    if installed:
        how = (f"tf_keras is installed: set {LEGACY_ENV}=1 (aiakrun --horovod-compat sets it "
               f"when {LEGACY_ENV} is not set at all)")
    else:
        minor = ".".join(tf_version.split(".")[:2])
        how = (f"install Keras 2 with `pip install --no-deps tf-keras~={minor}.0` (TensorFlow "
               f"{tf_version}); aiakrun --horovod-compat then uses it, and with mpirun set "
               f"{LEGACY_ENV}=1")
    return f"{HINT_PREFIX}, and tf.keras is Keras 3 here: {how}"


def _error_text(exc: BaseException, tb: Optional[TracebackType]) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc))
    frames = traceback.extract_tb(tb) if tb is not None else []
    return text + ("\n" + (frames[-1].line or "") if frames else "")


def _tf_version() -> str:
    tf = sys.modules.get("tensorflow")
    return str(getattr(tf, "__version__", "2"))


def install() -> None:
    """Chain :func:`excepthook` in front of the current ``sys.excepthook`` (once)."""
    previous = sys.excepthook
    if getattr(previous, "_aiak_keras_hint", False):
        return

    def excepthook(kind: Type[BaseException], exc: BaseException,
                   tb: Optional[TracebackType]) -> None:
        previous(kind, exc, tb)
        try:
            if keras3_in_use() and is_keras2_idiom_error(_error_text(exc, tb)):
                sys.stderr.write(hint(_tf_version(), tf_keras_installed()) + "\n")
                sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a hint must never hide the error itself
            pass

    excepthook._aiak_keras_hint = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook
