"""``horovod.tensorflow`` -> ``aiak_training.tensorflow`` (live attribute lookups)."""
from horovod import _aiak_alias

_impl = _aiak_alias.reexport(globals(), "aiak_training.tensorflow",
                             submodules=("mpi_ops", "compression", "functions",
                                         "sync_batch_norm", "elastic", "keras"))
