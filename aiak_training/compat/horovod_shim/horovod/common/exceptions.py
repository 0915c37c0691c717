"""``horovod.common.exceptions`` -> ``aiak_training.common.exceptions``.

Aliased (not copied) so that ``except horovod.common.exceptions.HorovodInternalError`` catches
exactly the class aiak-training raises.
"""
from horovod import _aiak_alias

_aiak_alias.alias(__name__, "aiak_training.common.exceptions")
