"""Hierarchical reduce-scatter and allgather, for the sharded optimizer's collectives.

On a cluster of C nodes with L ranks each, a flat reduce-scatter sends (N-1)/N of the
buffer through the slow cross-node links from every rank.  This module splits it in two
levels, on the same node and cross-node communicators as the hierarchical allreduce
(:class:`~aiak_training.common.topology.Topology`), so only 1/L of it crosses nodes per rank:

reduce-scatter
    1. the input is copied, with the prescale factor, into a staging buffer where the blocks
       that end on local rank l (one per node) lie next to each other, in cross-rank order;
    2. reduce-scatter inside the node: local rank l keeps the node's sum of its piece;
    3. reduce-scatter across nodes between the ranks of equal local rank: each rank keeps
       the full sum of its own block, written straight into the output.

allgather (the reverse)
    1. allgather across nodes between the ranks of equal local rank, into the staging piece;
    2. allgather of the pieces inside the node;
    3. the blocks are copied from piece order back into global rank order in the output.

The communicators are the job's (MPI, or the Gloo transport's), so the transport stays the
job's own.  Only homogeneous clusters (every node the same number of ranks) qualify: with
unequal nodes a node lacking local rank l could not hand on its share of piece l.
"""
from typing import Dict, List, Sequence

import numpy as np

from aiak_training.allreduce._util import allgather_counts, mpi_buf
from aiak_training.common import native
from aiak_training.common.config import Config
from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp, mpi_op
from aiak_training.common.topology import Topology


def hierarchical_applies(config: Config, topology: Topology, is_global: bool) -> bool:
    """Whether the set's reduce-scatter and allgather run hierarchically: the global set on a
    homogeneous cluster of several nodes with several ranks each, unless the job asked for
    flat collectives (``AIAK_ALLREDUCE_ALGO=flat``, or ``HOROVOD_HIERARCHICAL_ALLREDUCE=0``
    with the default ``auto``).  The same answer on every rank."""
    if not is_global or topology.num_nodes < 2 or topology.local_size < 2 \
            or not topology.is_homogeneous:
        return False
    if config.allreduce_algo == "flat":
        return False
    return not (config.allreduce_algo == "auto" and config.hierarchical_allreduce is False)


class HierScatter:
    """The two-level reduce-scatter and allgather of one topology (module docstring).

    Made collectively (one allgather learns every rank's place); keeps a staging buffer that
    only grows.  Runs on the engine thread only.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        places = topology.comm.allgather((topology.cross_rank, topology.local_rank))
        # rank_at[l][c]: the global rank of local rank l on the node of cross rank c.
        self.rank_at: List[List[int]] = [[0] * topology.cross_size
                                         for _ in range(topology.local_size)]
        for r, (c, l) in enumerate(places):
            self.rank_at[l][c] = r
        self._staging = np.empty(0, dtype=np.uint8)
        self.runs = 0  # reduce-scatters and allgathers run through this object

    def _staging_addr(self, nbytes: int) -> int:
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, dtype=np.uint8)
        return self._staging.ctypes.data

    def _piece_layout(self, counts: Sequence[int], isz: int, base: int):
        """For the staging buffer at ``base``: per local rank, the element count of its
        piece, and the (staging address, global displacement in bytes, bytes) of every block
        in piece order."""
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        piece_counts, moves, off = [], [], base
        for ranks in self.rank_at:
            piece_counts.append(sum(counts[r] for r in ranks))
            for r in ranks:
                moves.append((off, displs[r] * isz, counts[r] * isz))
                off += counts[r] * isz
        return piece_counts, moves

    def reducescatter(self, src: int, out: int, counts: Sequence[int], dtype: DataType,
                      op: ReduceOp, prescale: float, postscale: float) -> None:
        """Reduce the ``sum(counts)`` elements at ``src`` over all ranks; this rank's block
        (``counts[rank]`` elements, rank order) lands at ``out``, scaled by ``postscale``."""
        self.runs += 1
        t, isz = self.topology, ITEMSIZE[dtype]
        total = sum(counts)
        if total == 0:
            return
        mine = counts[t.rank]
        piece_bytes = max(counts) * t.cross_size * isz
        staging = self._staging_addr(total * isz + piece_bytes)
        piece = staging + total * isz
        piece_counts, moves = self._piece_layout(counts, isz, staging)
        dsts = [d for d, _, n in moves if n]
        srcs = [src + s for _, s, n in moves if n]
        if prescale != 1.0:
            native.copy_scaled_batch(dsts, srcs, [n // isz for _, _, n in moves if n],
                                     int(dtype), prescale)
        else:
            native.copy_batch(dsts, srcs, [n for _, _, n in moves if n])
        mop = mpi_op(dtype, op)
        t.local_comm.Reduce_scatter(mpi_buf(staging, total, dtype),
                                    mpi_buf(piece, piece_counts[t.local_rank], dtype),
                                    recvcounts=piece_counts, op=mop)
        cross_counts = [counts[r] for r in self.rank_at[t.local_rank]]
        t.cross_comm.Reduce_scatter(mpi_buf(piece, piece_counts[t.local_rank], dtype),
                                    mpi_buf(out, mine, dtype), recvcounts=cross_counts, op=mop)
        native.scale(out, mine, int(dtype), postscale)

    def allgather(self, src: int, out: int, counts: Sequence[int], dtype: DataType) -> None:
        """Gather every rank's ``counts[rank]`` elements (this rank's at ``src``) into
        ``out`` in rank order."""
        self.runs += 1
        t, isz = self.topology, ITEMSIZE[dtype]
        total = sum(counts)
        if total == 0:
            return
        piece_bytes = max(counts) * t.cross_size * isz
        staging = self._staging_addr(total * isz + piece_bytes)
        piece = staging + total * isz  # apart from the gathered pieces: MPI wants no overlap
        piece_counts, moves = self._piece_layout(counts, isz, staging)
        cross_counts = [counts[r] for r in self.rank_at[t.local_rank]]
        allgather_counts(t.cross_comm, src, piece, cross_counts, dtype)
        allgather_counts(t.local_comm, piece, staging, piece_counts, dtype)
        keep = [(out + g, s, n) for s, g, n in moves if n]
        native.copy_batch([d for d, _, _ in keep], [s for _, s, _ in keep],
                          [n for _, _, n in keep])


_by_topology: Dict[int, HierScatter] = {}


def hier_scatter(topology: Topology) -> HierScatter:
    """The :class:`HierScatter` of ``topology``, made on first use (collective: every rank
    of the set reaches it at the same response) and dropped when the topology is freed."""
    key = id(topology)
    found = _by_topology.get(key)
    if found is None or found.topology is not topology:
        found = _by_topology[key] = HierScatter(topology)
        topology.add_finalizer(lambda: _by_topology.pop(key, None))
    return found


def made() -> List[HierScatter]:
    """The :class:`HierScatter` objects that exist now: one per topology whose collectives
    have run hierarchically (the engine's own, for tests that check which path it took)."""
    return list(_by_topology.values())
