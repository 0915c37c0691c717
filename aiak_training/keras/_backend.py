"""The framework under Keras in this process, and the adapter module that speaks to it.

Keras 3 runs on one backend per process (``KERAS_BACKEND``, else ``~/.keras/keras.json``).
Only that backend's adapter is imported, so a process on the torch backend never loads
TensorFlow and one on the TensorFlow backend never loads torch.  Both adapters offer the
same names: the basics (``init``, ``rank``, ...), the reduce ops, ``Compression``;
``reduce_gradients``, ``is_sparse``, ``densify``, ``divide_gradient`` for the optimizer;
``broadcast_variables``; the value collectives; ``LIVE_HYPERPARAMETERS`` and ``live_float``.
"""
import importlib
from types import ModuleType

import keras

_ADAPTERS = {"tensorflow": "aiak_training.keras._tf_ops",
             "torch": "aiak_training.keras._torch_ops"}


def name() -> str:
    """The Keras backend of this process (``"tensorflow"``, ``"torch"``, ...)."""
    return keras.backend.backend()


def adapter() -> ModuleType:
    """The adapter module of this process's backend; ``ImportError`` for a backend that
    aiak_training cannot drive (JAX's compiled steps have no place for a collective)."""
    backend = name()
    if backend not in _ADAPTERS:
        raise ImportError(
            f"aiak_training.keras runs on the Keras backends tensorflow and torch; this "
            f"process uses {backend!r}. Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch "
            "before Keras is imported.")
    return importlib.import_module(_ADAPTERS[backend])
