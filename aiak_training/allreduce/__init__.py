"""Allreduce algorithms, one module each.  They reduce a contiguous buffer in place.

Signature of every algorithm::

    algorithm(comms: Topology, addr: int, count: int, dtype: DataType, op: ReduceOp) -> None

``addr`` is the raw address of ``count`` elements of ``dtype``.  Average is reduced as Sum;
the engine applies the scale factors.
"""
from typing import Callable

from aiak_training.allreduce.flat import flat_allreduce
from aiak_training.common.dtypes import DataType, ReduceOp
from aiak_training.common.topology import Topology

Algorithm = Callable[[Topology, int, int, DataType, ReduceOp], None]

ALGORITHMS = {"flat": flat_allreduce}


def select_algorithm(name: str, topology: Topology) -> Algorithm:
    """Pick the algorithm for ``AIAK_ALLREDUCE_ALGO`` = ``name`` on this topology."""
    if name not in ("flat", "auto", "hierarchical"):
        raise ValueError(f"Unknown allreduce algorithm {name!r}.")
    return ALGORITHMS["flat"]
