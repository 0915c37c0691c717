"""``horovod.torch.compression`` -> ``aiak_training.torch.compression`` (else the package)."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.torch.compression", "aiak_training.torch")
