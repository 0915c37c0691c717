"""``horovod.tensorflow.keras.callbacks`` -> ``aiak_training.tensorflow.keras.callbacks``."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.tensorflow.keras.callbacks")
