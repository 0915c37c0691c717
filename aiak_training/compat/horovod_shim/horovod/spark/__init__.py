"""``horovod.spark`` -> ``aiak_training.spark`` (``run``; ``run_elastic`` raises until elastic
training exists).  Needs the ``spark`` extra; without it, the import fails with
aiak_training.spark's ImportError, which names the extra to install.
"""
from horovod import _aiak_alias

_impl = _aiak_alias.reexport(globals(), "aiak_training.spark")
