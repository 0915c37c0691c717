"""``horovod.tensorflow.mpi_ops`` -> ``aiak_training.tensorflow.mpi_ops`` (or the package)."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.tensorflow.mpi_ops", "aiak_training.tensorflow")
