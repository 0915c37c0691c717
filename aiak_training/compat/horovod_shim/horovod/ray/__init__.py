"""``horovod.ray`` -> ``aiak_training.ray`` (every attribute is looked up live there).

Needs the ``ray`` extra; without it, the import fails with aiak_training.ray's ImportError,
which names the extra to install.
"""
from horovod import _aiak_alias

_impl = _aiak_alias.reexport(globals(), "aiak_training.ray")
