"""``horovod.common.elastic`` -> ``aiak_training.elastic`` (State, ObjectState, run_fn)."""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.elastic")
