"""``horovod.keras.callbacks`` -> ``aiak_training.keras.callbacks``."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.keras.callbacks")
