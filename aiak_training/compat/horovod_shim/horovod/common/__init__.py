"""``horovod.common``: the framework-independent parts that user code imports directly."""
