"""Which Keras this process trains with: Keras 3, or Keras 2 (``tf_keras``).

TensorFlow >= 2.16 ships Keras 3 as ``tf.keras``; programs that keep Keras 2 install
``tf_keras`` and set ``TF_USE_LEGACY_KERAS=1``, which makes ``tf.keras`` resolve to it.  An
older stack may also have Keras 2 itself installed as ``keras``.  ``aiak_training.keras``
and ``aiak_training.tensorflow.keras`` serve whichever of them that is, with Horovod's
Keras 2 behaviour for Keras 2 (``aiak_training.keras.legacy``).
"""
import importlib
import os
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

from aiak_training.common.grouping import LocalGradients

_TRUE = ("1", "true", "yes")


def legacy() -> Optional[ModuleType]:
    """The Keras 2 module of this process (``tf_keras``, or ``keras`` 2.x), or None when the
    process uses Keras 3."""
    if os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in _TRUE:
        try:
            return importlib.import_module("tf_keras")
        except ImportError as exc:
            raise ImportError(
                "TF_USE_LEGACY_KERAS=1 asks for Keras 2, but tf_keras is not installed: "
                "pip install 'aiak-training[tf_keras]' (tf-keras matching your TensorFlow), "
                "or unset TF_USE_LEGACY_KERAS to use Keras 3.") from exc
    keras = importlib.import_module("keras")
    if str(getattr(keras, "__version__", "3")).startswith("2."):
        return keras
    return None


def describe(module: ModuleType) -> str:
    """``"tf_keras 2.21.0"`` / ``"Keras 3.15.1"``: a Keras module and its version."""
    name = "tf_keras" if module.__name__.split(".")[0] == "tf_keras" else "Keras"
    return f"{name} {getattr(module, '__version__', '?')}"


def keras_of(obj: Any) -> Optional[str]:
    """``"tf_keras"`` or ``"keras"``: the package an object's class comes from (its own or
    a base class's), None for neither."""
    for cls in type(obj).__mro__:
        top = (cls.__module__ or "").split(".")[0]
        if top in ("tf_keras", "keras"):
            return top
    return None


def mixed_error(what: str, obj: Any, expected: ModuleType) -> ValueError:
    """The error for a Keras object of the other Keras than the process uses."""
    theirs = keras_of(obj)
    other = importlib.import_module("tf_keras" if theirs == "tf_keras" else "keras")
    if describe(expected).startswith("tf_keras"):
        who = (" by aiakrun --horovod-compat, since tf_keras is installed; run with "
               "TF_USE_LEGACY_KERAS=0 to train with Keras 3"
               if os.environ.get("AIAK_COMPAT_KERAS2") == "1" else "")
        advice = f"Build them with tf.keras / tf_keras (TF_USE_LEGACY_KERAS=1 is set{who})."
    else:
        advice = ("Build them with keras (Keras 3), or set TF_USE_LEGACY_KERAS=1 before "
                  "TensorFlow is imported to train with tf_keras.")
    return ValueError(
        f"{what} got {type(obj).__module__}.{type(obj).__name__}, an object of "
        f"{describe(other)}, but this process trains with {describe(expected)}: one model "
        "and its optimizer must come from one Keras. " + advice)


class WrapperState:
    """What a distributed optimizer of either Keras knows beyond its wrapped class: the prefix
    of its operations' names, the options of its reductions, its process set and its local
    variables (told apart by ``key``).  A plain object, set with ``object.__setattr__``, so
    that Keras tracks none of it: nothing enters the optimizer's variables or config."""

    def __init__(self, scope: str, reduce_options: Dict[str, Any], process_set: Any,
                 scale_local_gradients: bool, key: Callable[[Any], Any]):
        self.scope = scope
        self.reduce_options = reduce_options
        self.process_set = process_set
        # The variables whose gradients stay on this rank.
        self.local = LocalGradients(key, scale_local_gradients)


def distributed_subclass(cache: Dict[type, type], mixin: type, base: type,
                         module: Callable[[type], str]) -> type:
    """The subclass of ``base`` that ``mixin`` makes distributed, made once per class and
    kept in ``cache`` (a class made here maps back to its ``_aiak_base``).  It carries
    ``base``'s name and qualified name, and ``module(base)`` as its module: where Keras
    saves the original, so that a saved model names the plain optimizer."""
    base = getattr(base, "_aiak_base", base)
    cls = cache.get(base)
    if cls is None:
        cls = type(base)(base.__name__, (mixin, base),
                         {"__module__": module(base), "__qualname__": base.__qualname__,
                          "_aiak_base": base})
        cache[base] = cls
    return cls


def local_layers(layers: Any, module: ModuleType) -> List[Any]:
    """``PartialDistributedOptimizer``'s ``local_layers`` as a list of layers of ``module``
    (a layer, a list of them, or None); Horovod's ValueError for anything else, naming both
    Kerases for a layer of the other one."""
    from aiak_training.common import horovod_strings as hs
    if layers is None:
        return []
    if isinstance(layers, module.layers.Layer):
        return [layers]
    found = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    for layer in found:
        if not isinstance(layer, module.layers.Layer):
            if keras_of(layer) is not None:
                raise mixed_error("PartialDistributedOptimizer", layer, module)
            raise ValueError(hs.LOCAL_LAYERS_TYPE)
    return found


def partial_optimizer(distributed: Callable[..., Any], module: ModuleType, optimizer: Any,
                      layers: Any, options: Dict[str, Any]) -> Any:
    """``PartialDistributedOptimizer`` of either Keras: ``distributed(optimizer,
    **options)`` (that Keras's ``DistributedOptimizer``) with the trainable weights of
    ``layers`` (checked first, see :func:`local_layers`) registered as local variables."""
    kept = local_layers(layers, module)
    wrapped = distributed(optimizer, **options)
    for layer in kept:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped


def live_models(module: ModuleType) -> List[Any]:
    """Every live model of ``module`` (a Keras), sorted by name, so that all ranks walk them
    in the same order (``broadcast_global_variables``).  ValueError when two share a name:
    their order could not be agreed."""
    import gc
    gc.collect()
    # type() rather than isinstance(): some objects (lazy modules) answer __class__ lookups.
    models = [obj for obj in gc.get_objects() if issubclass(type(obj), module.Model)]
    models.sort(key=lambda m: m.name)
    for first, second in zip(models, models[1:]):
        if first.name == second.name:
            raise ValueError(
                f"broadcast_global_variables: two live Keras models are both named "
                f"{first.name!r}, so their order cannot be agreed between ranks. Name them "
                "apart, or broadcast their variables explicitly with "
                "BroadcastGlobalVariablesCallback or hvd.broadcast_variables.")
    return models
