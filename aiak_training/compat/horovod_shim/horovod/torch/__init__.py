"""``horovod.torch`` -> ``aiak_training.torch`` (every attribute is looked up live there)."""
from horovod import _aiak_alias

_impl = _aiak_alias.reexport(
    globals(), "aiak_training.torch",
    submodules=("mpi_ops", "optimizer", "compression", "functions", "sync_batch_norm",
                "elastic"))
