"""``horovod.torch.mpi_ops``: alias of ``aiak_training.torch.mpi_ops`` (else of the package)."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.torch.mpi_ops", "aiak_training.torch")
