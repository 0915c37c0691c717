"""Allreduce algorithms, one module each.  They reduce a contiguous buffer in place.

Signature of every algorithm::

    algorithm(comms: Topology, addr: int, count: int, dtype: DataType, op: ReduceOp) -> None

``addr`` is the raw address of ``count`` elements of ``dtype``.  Average is reduced as Sum;
the engine applies the scale factors.
"""
from typing import Callable

from aiak_training.allreduce.flat import flat_allreduce
from aiak_training.common.config import Config
from aiak_training.common.dtypes import DataType, ReduceOp
from aiak_training.common.topology import Topology

Algorithm = Callable[[Topology, int, int, DataType, ReduceOp], None]

ALGORITHMS = {"flat": flat_allreduce}


def select_algorithm(config: Config, topology: Topology, is_global: bool) -> Algorithm:
    """Pick the allreduce algorithm of a process set (the same on every rank of it)."""
    return ALGORITHMS["flat"]
