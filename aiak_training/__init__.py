"""aiak-training: a Horovod-compatible distributed-training library.

Use it as ``import aiak_training.torch as hvd`` in place of ``import horovod.torch as hvd``.
"""
__version__ = "0.1.0"
HOROVOD_API_VERSION = "0.28.1"
