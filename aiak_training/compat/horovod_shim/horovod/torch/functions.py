"""``horovod.torch.functions``: alias of ``aiak_training.torch.functions`` (else of the package)."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.torch.functions", "aiak_training.torch")
