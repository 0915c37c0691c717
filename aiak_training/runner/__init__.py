"""``aiakrun``: the horovodrun-compatible launcher.

:mod:`launch` is the entry point (:func:`aiak_training.runner.launch.main`, the console script
and ``python -m aiak_training.runner.launch``); it parses the command line (``cli/``) and hands
the job to one mode (``modes/``: MPI, Gloo, elastic, Ray/Spark jobs, ``--advise``), which runs
it under the guards (``guard/``: supervision, the per-rank task wrapper, liveness) and reports
how it ended (``report/``).

Kept free of imports on purpose, as are the four subpackages: every rank starts ``python -m
aiak_training.runner.guard.task_wrapper``, which imports these packages first, and that must
stay fast.
"""
