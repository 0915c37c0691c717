"""What every layer shares: settings, dtypes, messages, topology, timeline, Horovod's strings;
``gpu/`` is the CUDA data path, ``job/`` what aiakrun and its ranks share, ``host/`` this
host's build and network interfaces."""
