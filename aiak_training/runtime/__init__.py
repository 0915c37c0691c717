"""The runtime: the background engine that negotiates and runs collectives, its executors,
and the framework-independent ``hvd`` calls (``init``, ``rank``, process sets, ...).

It sits above ``common`` (types, settings, bindings) and ``allreduce`` (the algorithms), and
below the frontends (``torch``, ``tensorflow``), which only adapt tensors to it.
"""
