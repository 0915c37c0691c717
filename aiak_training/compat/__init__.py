"""Horovod compatibility switch: run unmodified ``import horovod.torch as hvd`` scripts.

The shim package lives in ``horovod_shim/horovod``.  It is deliberately *not* importable by
default: only the switch (``aiakrun --horovod-compat``, ``AIAK_HOROVOD_COMPAT=1`` with aiakrun,
or ``PYTHONPATH=$(python -m aiak_training.compat --pythonpath)`` for plain mpirun) puts
``horovod_shim`` at the front of PYTHONPATH.  A real Horovod installation is never shadowed:
the switch refuses to turn on when one is importable, and the shim itself raises ImportError if
it is imported while a real one exists further down the path.
"""
from __future__ import annotations

import importlib.machinery
import os
import sys
from typing import Iterable, List, Optional

from aiak_training.common.env import env_bool

COMPAT_ENV = "AIAK_HOROVOD_COMPAT"


class RealHorovodError(RuntimeError):
    """A real Horovod is installed, so the shim must not be put in front of it."""


def shim_dir() -> str:
    """Directory to prepend to PYTHONPATH (it contains the ``horovod`` shim package)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_shim")


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a or ".", b)
    except OSError:
        return False


def find_real_horovod(search_path: Optional[Iterable[str]] = None) -> Optional[str]:
    """Location of a ``horovod`` package or module on ``search_path`` (default ``sys.path``)
    other than the shim, or None.

    Namespace directories (a folder named ``horovod`` without ``__init__.py``, e.g. a source
    checkout's parent) are not installations and are ignored.
    """
    shim = shim_dir()
    paths: List[str] = [p for p in (sys.path if search_path is None else search_path)
                        if not _same_dir(p, shim)]
    spec = importlib.machinery.PathFinder.find_spec("horovod", paths)
    if spec is None or spec.origin in (None, "namespace"):
        return None
    return spec.origin


def compat_requested(flag: bool, environ: Optional[dict] = None) -> bool:
    """True if ``--horovod-compat`` was given or ``AIAK_HOROVOD_COMPAT`` is set to a true value."""
    return flag or env_bool(COMPAT_ENV, environ=environ)


def compat_pythonpath(current: Optional[str], extra_search_path: Iterable[str] = ()) -> str:
    """PYTHONPATH value with the shim in front of ``current``.

    Raises RealHorovodError if a real Horovod is importable from ``current``, this interpreter's
    sys.path or ``extra_search_path``: putting the shim first would silently replace it.
    """
    entries = [p for p in (current or "").split(os.pathsep) if p]
    real = find_real_horovod(entries + list(extra_search_path) + sys.path)
    if real:
        raise RealHorovodError(
            f"a real Horovod is installed at {real}; the aiak-training compatibility shim "
            f"({shim_dir()}) would shadow it. Uninstall horovod (pip uninstall horovod) or "
            "run without --horovod-compat / AIAK_HOROVOD_COMPAT and import aiak_training.torch.")
    shim = shim_dir()
    return os.pathsep.join([shim] + [p for p in entries if not _same_dir(p, shim)])
