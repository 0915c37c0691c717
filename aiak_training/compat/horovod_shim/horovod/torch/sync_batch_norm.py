"""``horovod.torch.sync_batch_norm``: alias of aiak_training.torch.sync_batch_norm (or torch)."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.torch.sync_batch_norm", "aiak_training.torch")
