"""``horovod.tensorflow.sync_batch_norm`` -> ``aiak_training.tensorflow.sync_batch_norm``."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.tensorflow.sync_batch_norm")
