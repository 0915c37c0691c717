"""``horovod.tensorflow.keras.elastic`` -> ``aiak_training.tensorflow.keras.elastic``."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.tensorflow.keras.elastic")
