"""aiak-training's stand-in for the ``horovod`` package (Horovod 0.28.1 API).

Only on sys.path when the Horovod compatibility switch is on (see ``aiak_training.compat``).
``import horovod.torch as hvd`` then loads ``aiak_training.torch``.  This file refuses to load
if a real Horovod is installed anywhere else on sys.path, because silently replacing a real
installation would make results depend on PYTHONPATH order.
"""
import importlib.machinery as _machinery
import os as _os
import sys as _sys

__version__ = "0.28.1"
_SHIM_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


def _real_horovod():
    def same(a, b):
        try:
            return _os.path.samefile(a or ".", b)
        except OSError:
            return False

    paths = [p for p in _sys.path if not same(p, _SHIM_ROOT)]
    spec = _machinery.PathFinder.find_spec("horovod", paths)
    if spec is None or spec.origin in (None, "namespace"):
        return None
    return spec.origin


_real = _real_horovod()
if _real is not None:
    raise ImportError(
        f"the aiak-training Horovod compatibility shim ({_os.path.abspath(__file__)}) was "
        f"imported, but a real Horovod is installed at {_real}. Refusing to shadow it: remove "
        f"{_SHIM_ROOT} from PYTHONPATH (drop --horovod-compat / AIAK_HOROVOD_COMPAT) to use the "
        "real Horovod, or uninstall it to use aiak-training.")
del _real


def run(*_args, **_kwargs):
    """horovod.run() is not provided; launch scripts with aiakrun instead."""
    raise NotImplementedError("horovod.run() is not supported by aiak-training; launch the "
                              "script with `aiakrun -np N python script.py` instead")


# A Keras 3 error in a Horovod (Keras 2) script ends with a line on getting Keras 2.
from aiak_training.compat import keras_hint as _keras_hint  # noqa: E402

_keras_hint.install()
del _keras_hint
