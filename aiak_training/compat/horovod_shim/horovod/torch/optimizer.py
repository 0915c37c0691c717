"""``horovod.torch.optimizer``: alias of ``aiak_training.torch.optim`` (else of the package)."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.torch.optim", "aiak_training.torch")
