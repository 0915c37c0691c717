"""``horovod.common.process_sets`` -> ``aiak_training.runtime.sets.process_sets``."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.runtime.sets.process_sets")
