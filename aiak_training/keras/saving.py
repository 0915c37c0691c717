"""``load_model``: a saved Keras model, compiled with its optimizer wrapped in
``DistributedOptimizer``.

Keras 3 stores an optimizer under its class (``keras.optimizers.SGD``), and built-in
classes are found before ``custom_objects`` are consulted, so the wrapper cannot be slipped
in while Keras deserializes.  The model is therefore loaded as Keras loads it, optimizer
state included, and then compiled again with the same compile arguments and the loaded
optimizer wrapped (the wrapper takes over the loaded slots, iteration count and learning
rate).
"""
from typing import Any, Dict, Optional, Sequence

import keras

from aiak_training.keras import _backend
from aiak_training.keras.optimizer import DistributedOptimizer, is_distributed

_ops = _backend.adapter()
Compression = _ops.Compression


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> keras.Model:
    """Load a model saved with ``model.save`` (``.keras``, or ``.h5``) and wrap its
    optimizer in :func:`DistributedOptimizer` with ``compression``.

    Arguments:
        filepath: the saved model.
        custom_optimizers: optimizer classes of your own that the file may name (found by
            class name).
        custom_objects: other custom classes and functions, by name, as for Keras.
        compression: the wrapper's compression.
        legacy_opts: Keras 2's ``tf.keras.optimizers.legacy`` classes; Keras 3 has none, so
            only False is accepted.

    Returns:
        The model, compiled with the distributed optimizer if it was saved compiled.
    """
    if legacy_opts:
        raise ValueError("legacy_opts=True asks for Keras 2's legacy optimizers, which "
                         "Keras 3 does not have.")
    objects: Dict[str, Any] = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or is_distributed(optimizer) or not model.compiled:
        return model
    with keras.saving.custom_object_scope(objects):
        arguments = keras.saving.deserialize_keras_object(model.get_compile_config())
    arguments["optimizer"] = DistributedOptimizer(optimizer, compression=compression)
    model.compile(**arguments)
    return model
