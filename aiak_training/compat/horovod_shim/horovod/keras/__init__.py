"""``horovod.keras`` -> ``aiak_training.keras`` (live attribute lookups; Keras 3 on the
TensorFlow or torch backend)."""
from horovod import _aiak_alias

_impl = _aiak_alias.reexport(globals(), "aiak_training.keras", submodules=("callbacks", "elastic"))
