"""``horovod.keras.elastic`` -> ``aiak_training.keras.elastic``."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.keras.elastic")
