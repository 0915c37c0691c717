"""``aiakrun``: the horovodrun-compatible launcher.

Kept free of imports on purpose: every rank starts ``python -m
aiak_training.runner.task_wrapper``, which imports this package first, and that must stay fast.
The entry point is :func:`aiak_training.runner.launch.main`.
"""
