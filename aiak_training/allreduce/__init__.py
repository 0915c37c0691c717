"""Allreduce algorithms, one module each.  They reduce a contiguous buffer in place.

Signature of every algorithm::

    algorithm(comms: Topology, addr: int, count: int, dtype: DataType, op: ReduceOp) -> None

``addr`` is the raw address of ``count`` elements of ``dtype``.  Average is reduced as Sum;
the engine applies the scale factors.

* ``flat`` (flat.py): the MPI library's allreduce on the whole communicator.
* ``hier_staged`` (hier_staged.py): reduce-scatter in the node, allreduce across nodes,
  allgather in the node, one stage after the other (Horovod's hierarchical scheme); the
  baseline.
* ``hier_pipelined`` (hier_pipelined.py): the same three stages pipelined over chunks, with
  the in-node stages in shared memory.
* ``hier_nccl`` (hier_nccl.py): the pipelined scheme on NCCL, for GPU buffers.

Their earlier names ``horovod-hier`` and ``aiak-hier`` are accepted as aliases.

:func:`select_algorithm` turns ``AIAK_ALLREDUCE_ALGO`` / ``HOROVOD_HIERARCHICAL_ALLREDUCE`` and
the topology into one of them; :func:`create_algorithm` builds one by name (tests and
benchmarks use it directly).

hier_scatter.py is not an allreduce: it holds the two-level reduce-scatter and allgather the
engine runs for ``hvd.reducescatter``/``hvd.allgather`` on multi-node topologies.
"""
import logging
from typing import Callable, Tuple

from aiak_training.allreduce.flat import flat_allreduce
from aiak_training.common.config import ALLREDUCE_ALGO_ALIASES, Config
from aiak_training.common.dtypes import DataType, ReduceOp
from aiak_training.common.topology import Topology
from aiak_training.common.tuning import ALGORITHMS, ALLREDUCE_ALGORITHM

Algorithm = Callable[[Topology, int, int, DataType, ReduceOp], None]

# ALGORITHMS, the names :func:`create_algorithm` accepts, is the knob table's (imported above).

log = logging.getLogger("aiak_training")


def resolve_algorithm(config: Config, topology: Topology, is_global: bool) -> Tuple[str, str]:
    """(algorithm name, why) for a process set.  Pure: depends only on the settings and the
    topology, which every rank of the set sees identically.

    Rules:

    * process sets other than the global one use ``flat`` (their ranks need not form whole
      nodes, and the shared windows belong to the global set);
    * ``AIAK_ALLREDUCE_ALGO=flat|hier_staged|hier_pipelined`` is taken as asked, except that
    * every hierarchical choice becomes ``flat`` on a single node, or with one rank on every
      node, where there is no second level (Horovod ignores its switch on one node, too);
    * ``hierarchical`` means ``hier_pipelined``;
    * ``auto`` (the default) means ``hier_pipelined`` when there is more than one node and
      more than one rank on some node, ``flat`` otherwise; with ``auto``, a set
      ``HOROVOD_HIERARCHICAL_ALLREDUCE`` decides: ``1`` asks for ``hierarchical`` and ``0``
      for ``flat`` (Horovod's own algorithm), as with horovodrun.  An explicit
      ``AIAK_ALLREDUCE_ALGO`` wins over ``HOROVOD_HIERARCHICAL_ALLREDUCE``.
    """
    if not is_global:
        return "flat", "process sets other than the global one use flat"
    if getattr(getattr(topology, "comm", None), "transport", "mpi") == "gloo":
        # The hierarchical schemes use MPI shared-memory windows; Gloo runs its own allreduce.
        return "flat", "the Gloo transport uses Gloo's allreduce"
    requested = config.allreduce_algo
    algo_var, hier_var = ALLREDUCE_ALGORITHM.env
    source = f"{algo_var}={requested}"
    hier = config.hierarchical_allreduce
    if requested == "auto" and hier is not None:
        requested = "hierarchical" if hier else "flat"
        source = f"{hier_var}={int(hier)}"
    elif requested != "auto" and hier is not None:
        source += f" (overrides {hier_var}={int(hier)})"
    if requested == "flat":
        return "flat", source
    nodes = topology.num_nodes
    if nodes < 2:
        return "flat", f"{source}, but there is a single node"
    if topology.size == nodes:
        return "flat", f"{source}, but every node has one rank"
    if requested in ("auto", "hierarchical"):
        return "hier_pipelined", source
    if requested in ALGORITHMS:
        return requested, source
    raise ValueError(f"Unknown allreduce algorithm {requested!r}.")


def create_algorithm(name: str, topology: Topology, **options) -> Algorithm:
    """Build algorithm ``name`` for ``topology``.  Collective over ``topology.comm`` for the
    hierarchical ones (hier_pipelined allocates its shared window).  Stateful algorithms have a
    ``close()`` method, collective as well; ``options`` go to their constructor."""
    name = ALLREDUCE_ALGO_ALIASES.get(name, name)
    if name == "flat":
        return flat_allreduce
    if name == "hier_staged":
        from aiak_training.allreduce.hier_staged import StagedHierAllreduce
        return StagedHierAllreduce(topology)
    if name == "hier_pipelined":
        from aiak_training.allreduce.hier_pipelined import (PipelinedHierAllreduce,
                                                       SharedMemoryUnavailable,
                                                       shared_memory_usable)
        from aiak_training.allreduce.hier_staged import StagedHierAllreduce
        if not shared_memory_usable(topology):
            if topology.rank == 0:
                log.warning("hier_pipelined needs the ranks of a node to share memory, and these "
                            "do not (HOROVOD_HOSTNAME spans machines?); using hier_staged.")
            return StagedHierAllreduce(topology)
        try:
            return PipelinedHierAllreduce(topology, **options)
        except SharedMemoryUnavailable as exc:  # the same on every rank
            if topology.rank == 0:
                log.warning("hier_pipelined: %s; using hier_staged. Give the ranks more shared "
                            "memory (/dev/shm, e.g. docker --shm-size) or lower "
                            "AIAK_HIER_CHUNK_BYTES / AIAK_HIER_SLOTS.", exc)
            return StagedHierAllreduce(topology)
    raise ValueError(f"Unknown allreduce algorithm {name!r}; expected one of {ALGORITHMS}.")


def close_algorithm(algorithm: Algorithm) -> None:
    """Release what ``algorithm`` holds (collective for hier_pipelined); a no-op for flat."""
    close = getattr(algorithm, "close", None)
    if close is not None:
        close()


def select_algorithm(config: Config, topology: Topology, is_global: bool) -> Algorithm:
    """Pick the allreduce algorithm of a process set (the same on every rank of it).

    ``config.allreduce_algo`` is ``AIAK_ALLREDUCE_ALGO``; ``HOROVOD_HIERARCHICAL_ALLREDUCE=1``
    asks for the hierarchical path.  Process sets other than the global one use flat.  See
    :func:`resolve_algorithm` for the rules.  The choice is logged at INFO on global rank 0.
    The algorithm's resources are released by ``topology.free()``.
    """
    name, why = resolve_algorithm(config, topology, is_global)
    algorithm = create_algorithm(name, topology)
    if getattr(algorithm, "close", None) is not None:
        topology.add_finalizer(algorithm.close)
    if is_global and topology.rank == 0:
        actual = getattr(algorithm, "name", "flat")
        extra = ""
        if actual == "hier_pipelined":
            extra = (f"; {algorithm.owners} stream(s) per node, chunk {algorithm.chunk_bytes} "
                     f"bytes, {algorithm.slots} slots")
        log.info("allreduce algorithm: %s (%s; %d node(s), ranks per node %s)%s", actual, why,
                 topology.num_nodes, topology.node_sizes, extra)
    return algorithm
