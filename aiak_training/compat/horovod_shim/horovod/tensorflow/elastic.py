"""``horovod.tensorflow.elastic`` -> ``aiak_training.tensorflow.elastic`` if aiak-training
provides it."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.tensorflow.elastic")
