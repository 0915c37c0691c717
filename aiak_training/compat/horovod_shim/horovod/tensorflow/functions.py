"""``horovod.tensorflow.functions`` -> ``aiak_training.tensorflow.functions``."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.tensorflow.functions")
