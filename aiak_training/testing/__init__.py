"""Test and benchmark helpers for aiak-training.

``aiak_training.testing.cluster`` emulates a multi-node cluster with a slow network on one
Linux machine (network namespaces joined by rate-limited veth links); see its docstring.
Nothing here is imported by the training library itself.
"""
