"""Which Lightning a strategy is built for: ``lightning.pytorch`` or ``pytorch_lightning``.

The two distributions ship the same trainer under two module names (with ``lightning.fabric``
and ``lightning_fabric`` beside them), and a ``Trainer`` accepts only strategies derived from
its own package's ``Strategy``.  The script's choice is the one it has imported.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Optional, Tuple

#: Trainer package -> the fabric package it is built on.
PACKAGES = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}

INSTALL_HINT = ("pip install 'aiak-training[lightning]' (Lightning 2.x; it does not replace "
                "the installed torch)")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package of a dotted name is missing
        return False


def choose(package: Optional[str] = None) -> str:
    """The trainer package to build for.

    ``package`` names it; otherwise the one the process has imported; otherwise the one that
    is installed (``lightning.pytorch`` first).  ValueError when both are imported and none
    is named, since a strategy made for one is refused by the other's ``Trainer``.
    """
    if package is not None:
        if package not in PACKAGES:
            raise ValueError(f"package={package!r}: expected one of {', '.join(PACKAGES)}")
        return package
    loaded = [name for name in PACKAGES if name in sys.modules]
    if len(loaded) == 1:
        return loaded[0]
    if len(loaded) > 1:
        raise ValueError("both lightning.pytorch and pytorch_lightning are imported: pass "
                         "package='lightning.pytorch' or package='pytorch_lightning' (the one "
                         "whose Trainer you use)")
    for name in PACKAGES:
        if _installed(name):
            return name
    raise ImportError(f"aiak_training.lightning needs Lightning 2: {INSTALL_HINT}")


def modules(package: str) -> Tuple[ModuleType, ModuleType]:
    """(trainer package, fabric package), imported; ImportError naming the extra when the
    package is missing or not a 2.x release."""
    try:
        trainer = importlib.import_module(package)
        fabric = importlib.import_module(PACKAGES[package])
    except ImportError as exc:
        raise ImportError(f"{package} is not installed: {INSTALL_HINT}") from exc
    version = str(getattr(trainer, "__version__", "0"))
    if not version.startswith("2."):
        raise ImportError(f"{package} {version} is installed; aiak_training.lightning needs "
                          f"Lightning 2.x: {INSTALL_HINT}")
    return trainer, fabric
