"""``horovod.tensorflow.compression`` -> ``aiak_training.tensorflow.compression``."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.tensorflow.compression")
