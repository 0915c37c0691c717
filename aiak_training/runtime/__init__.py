"""The runtime: the background engine that negotiates and runs collectives, its executors,
and the framework-independent ``hvd`` calls (``init``, ``rank``, process sets, ...).

It sits above ``common`` (types, settings, bindings) and ``allreduce`` (the algorithms), and
below the frontends (``torch``, ``tensorflow``), which only adapt tensors to it.

``engine.py`` is the engine, ``entries.py`` the data it shares with the executors, and
``basics.py``/``current.py`` the ``hvd`` calls and this process's engine.  Below them:
``execute/`` (the lane's executors), ``sets/`` (process sets), ``arrays/`` (collectives on
numpy arrays and objects, for every frontend), ``diagnostics/`` (start-up line, stall
naming, watchdog), ``transport/`` (MPI and Gloo) and ``autotune/``.
"""
