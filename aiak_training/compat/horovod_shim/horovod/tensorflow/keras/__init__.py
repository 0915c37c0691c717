"""``horovod.tensorflow.keras`` -> ``aiak_training.tensorflow.keras`` (live attribute lookups)."""
from horovod import _aiak_alias

_impl = _aiak_alias.reexport(globals(), "aiak_training.tensorflow.keras",
                             submodules=("callbacks", "elastic"))
