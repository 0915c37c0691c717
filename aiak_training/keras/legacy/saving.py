"""``load_model`` and ``broadcast_global_variables`` for Keras 2 (``tf_keras``).

``load_model`` does what Horovod's does: Keras 2 looks optimizers up by their lower-case
class name, among them the ``custom_objects`` it is given, so every optimizer class of the
Keras 2 optimizer module (or of ``keras.optimizers.legacy`` with ``legacy_opts``), and each
of ``custom_optimizers``, is given there as a factory that builds the optimizer from the
saved config and wraps it in ``DistributedOptimizer``; Keras then restores its slots into
the wrapped optimizer.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from aiak_training.keras import _flavour
from aiak_training.keras.legacy.optimizer import DistributedOptimizer
from aiak_training.tensorflow import functions
from aiak_training.tensorflow.compression import Compression
from aiak_training.tensorflow.tf1 import broadcast_global_variables as _graph_broadcast

keras = _flavour.legacy()


def _subclasses(base: type) -> List[type]:
    found, todo = [], [base]
    while todo:
        for cls in todo.pop().__subclasses__():
            if cls not in found:
                found.append(cls)
                todo.append(cls)
    return found


def _wrapping(cls: type, compression: Any) -> Callable[..., Any]:
    def build(**config):
        return DistributedOptimizer(cls.from_config(config), compression=compression)
    return build


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None,
               compression: Any = Compression.none, legacy_opts: bool = False):
    """Load a Keras 2 model saved with ``model.save`` (``.keras``, ``.h5`` or SavedModel)
    with its optimizer wrapped in :func:`DistributedOptimizer` (``compression`` passed on).
    ``legacy_opts`` loads ``keras.optimizers.legacy`` classes; ``custom_optimizers`` are
    your own optimizer classes; ``custom_objects`` as for Keras."""
    base = keras.optimizers.legacy.Optimizer if legacy_opts else keras.optimizers.Optimizer
    objects: Dict[str, Any] = {}
    for cls in _subclasses(base):
        if cls.__module__.split(".")[0] == keras.__name__.split(".")[0] and \
                "_aiak_base" not in cls.__dict__:
            objects[cls.__name__.lower()] = _wrapping(cls, compression)
    for cls in custom_optimizers or ():
        objects[cls.__name__] = _wrapping(cls, compression)
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)


def broadcast_global_variables(root_rank: int) -> Any:
    """Overwrite the global variables with ``root_rank``'s values.

    In a TF1 graph (Keras 2's graph mode) these are ``tf.compat.v1.global_variables()``,
    broadcast in Keras's session, as Horovod does.  Eagerly TensorFlow keeps no such
    collection (Horovod's call fails there); here they are then the variables of the live
    Keras 2 models and their optimizers, in the order of the models' names.
    """
    if not tf.executing_eagerly():
        # Keras 2 exports get_session in its v1 API only (tf.compat.v1.keras resolves to it
        # under TF_USE_LEGACY_KERAS=1).
        get_session = getattr(keras.backend, "get_session", None) or \
            tf.compat.v1.keras.backend.get_session
        return get_session().run(_graph_broadcast(root_rank))
    seen, variables = set(), []
    for model in _flavour.live_models(keras):
        state = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            found = optimizer.variables
            state += list(found() if callable(found) else found)
        for var in state:
            if var.ref() not in seen:
                seen.add(var.ref())
                variables.append(var)
    if variables:
        functions.broadcast_variables(variables, root_rank)
    return None
