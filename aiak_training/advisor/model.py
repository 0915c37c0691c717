"""The advisor's step-time model: every formula behind its predictions, in one place.

Units: seconds, bytes, bytes per second.  A :class:`Link` is a bandwidth ``bw`` and a
per-message (per ring step) wire latency ``lat`` (the alpha-beta model: a message of ``b``
bytes costs ``lat + b / bw``).

Every collective also pays the engine's fixed cost once, ``op`` (:attr:`Cluster.op_s`):
negotiating the tensor with the other ranks, waking the background thread and launching the
operation.  It does not depend on the ring's length in steps, so it is charged once per
collective (:func:`allreduce_time`, :func:`dgc_exchange`), not once per ring step.  The advisor
measures it as the time of a 4-byte allreduce over all the job's ranks, which also covers
every wire hop of that collective; the measured links then carry ``lat = 0``.

Collectives, for ``b`` bytes per rank (each plus ``op``):

* **ring allreduce** over ``n`` ranks (:func:`ring_allreduce`)::

      T = 2(n-1)/n * b/bw + 2(n-1) * lat

  In a flat ring whose ranks are ordered by node, one ring edge per node crosses the network,
  so on a cluster the network link is ``bw`` and ``n`` is every rank (:func:`flat_allreduce`).
* **hierarchical, staged** over ``M`` nodes of ``L`` ranks (:func:`hier_staged`): reduce inside
  the node, ring allreduce across nodes, broadcast inside the node, one after another::

      T = T_intra + T_inter
      T_intra = 2(L-1)/L * b/bw_intra + 2(L-1) * lat_intra   (reduce-scatter + allgather)
      T_inter = 2(M-1)/M * b/bw_net   + 2(M-1) * lat_net     (L shards of b/L share the NIC)

* **hierarchical, pipelined** (:func:`hier_pipelined`): the node's shared-memory reduction
  (``SHM_PASSES`` passes over the buffer at the copy bandwidth) and the inter-node stage run
  on ``k = ceil(b / chunk)`` chunks in a pipeline::

      T = t_i + t_e + (k-1) * max(t_i, t_e),  t_i = T_shm / k,  t_e = T_inter / k

* **DGC** (:func:`dgc_exchange`): each compressed tensor of ``numel`` elements sends
  ``k = ceil(density * numel)`` (index, value) pairs and a 4-byte count, gathered from every
  rank by a ring allgather of ``p`` segments of ``s`` bytes::

      T = op + (p-1) * s/bw + (p-1) * lat,   s = sum(4 + k * (4 + value bytes))

  plus the selection, ``DGC_SELECT_S_PER_ELEMENT`` seconds per compressed element, and a
  dense allreduce of the tensors below ``DGC_MIN_NUMEL`` elements.

The step (:func:`predict_step`), from the measured local profile of one step with no
communication (:class:`Profile`: when each gradient became ready, when ``step()`` was
called, how long the update took):

* **fusion buffering**: every ``cycle_s`` the engine packs the gradients that are ready into
  buffers of at most ``fusion_bytes``; buffers go on the wire one at a time, each as soon as
  it is packed and the wire is free (:func:`schedule_buckets`).  This is also the **overlap
  of backward with communication**: buffers packed during backward are reduced while the
  later layers' gradients are still being computed.
* **plain**: ``T = max(t_call, last buffer done) + t_update``.
* **overlap_update**: each buffer's share of the update (``t_update * bytes / total``) starts
  when that buffer lands and the update before it is done, but not before ``t_call``.
* **fused optimizer**: the same, with the fused optimizer's measured update time.

The calibrated constants live in :data:`CONSTANTS`, nowhere else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple

from aiak_training.common.tuning import ALLREDUCE_ALGORITHM, DGC, FUSED_OPTIMIZER, OVERLAP_UPDATE


@dataclass(frozen=True)
class Constants:
    """Every calibrated or default constant of the model."""

    #: The engine's defaults (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME).
    fusion_bytes: int = 128 * 1024 * 1024
    cycle_s: float = 1e-3
    #: hier_pipelined's chunk (AIAK_HIER_CHUNK_BYTES default).
    hier_chunk_bytes: int = 4 * 1024 * 1024
    #: Passes over the buffer of the shared-memory stage: copy in, reduce, copy out.
    shm_passes: float = 3.0
    #: DGC defaults (Compression.dgc()): density after warm-up, tensors below min_numel
    #: elements stay dense, float32 values and int32 indices on the wire.
    dgc_density: float = 0.001
    dgc_min_numel: int = 1024
    dgc_value_bytes: int = 4
    dgc_index_bytes: int = 4
    #: Selection cost per compressed element when it was not measured (sampled threshold
    #: plus the momentum and residual updates; ~3 passes over float32 at ~3 GB/s).
    dgc_select_s_per_element: float = 4e-9
    #: Network latency assumed by a what-if without latency_us and without a measured link.
    default_latency_s: float = 50e-6


CONSTANTS = Constants()


@dataclass(frozen=True)
class Link:
    """A bandwidth in bytes/s and a latency in seconds per message."""

    bw: float
    lat: float


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``ranks_per_node`` ranks; ``net`` between nodes, ``intra`` between the
    ranks of a node over the transport, ``copy_bw`` the node's memory copy bandwidth."""

    nodes: int
    ranks_per_node: int
    net: Link
    intra: Link
    copy_bw: float
    gloo: bool = False
    #: The engine's fixed cost of one collective, charged once per collective.
    op_s: float = 0.0

    @property
    def size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def hierarchical(self) -> bool:
        """Whether a two-level allreduce exists here (as aiak_training.allreduce decides)."""
        return self.nodes > 1 and self.ranks_per_node > 1 and not self.gloo


@dataclass
class Profile:
    """One rank's step without communication, measured on the user's script.

    ``grads`` are ``(bytes, ready_s)`` in the order the gradients became ready; times are
    seconds since the step began (the end of the previous ``step()``).
    """

    grads: List[Tuple[int, float]]
    call_s: float
    update_s: float
    fused_update_s: Optional[float] = None
    grad_numels: List[int] = field(default_factory=list)
    dgc_select_s_per_element: Optional[float] = None

    @property
    def total_bytes(self) -> int:
        return sum(b for b, _ in self.grads)


@dataclass(frozen=True)
class Config:
    """One configuration of the table: a value of each knob the advisor varies (the knob
    table's rows with ``advisor`` set, common/tuning), whose flags it prints."""

    algo: str = "flat"            # one of the knob table's ALGORITHMS
    overlap: bool = False
    fused: bool = False
    dgc: bool = False

    @property
    def name(self) -> str:
        if self.dgc:
            return "dgc"
        extras = [x for x, on in (("overlap", self.overlap), ("fused", self.fused)) if on]
        return "+".join([self.algo] + extras)

    def flags_over(self, default: "Config") -> str:
        """The flags to add to a job that runs ``default`` (no flag) to get this row."""
        if self.dgc:
            return self.flags
        out = [f"{ALLREDUCE_ALGORITHM.flag} {self.algo}"] if self.algo != default.algo else []
        out += [knob.flag for knob, on in ((OVERLAP_UPDATE, self.overlap),
                                           (FUSED_OPTIMIZER, self.fused)) if on]
        return " ".join(out)

    @property
    def flags(self) -> str:
        if self.dgc:
            return DGC.script
        out = [f"{ALLREDUCE_ALGORITHM.flag} {self.algo}"]
        if self.overlap:
            out.append(OVERLAP_UPDATE.flag)
        if self.fused:
            out.append(FUSED_OPTIMIZER.flag)
        return " ".join(out)


def ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    """Ring allreduce of ``nbytes`` over ``n`` ranks: 2(n-1)/n * b/bw + 2(n-1) * lat."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / link.bw + 2.0 * (n - 1) * link.lat


def ring_allgather(segment_bytes: float, n: int, link: Link) -> float:
    """Ring allgather of one ``segment_bytes`` segment per rank: (n-1) * (s/bw + lat)."""
    if n <= 1:
        return 0.0
    return (n - 1) * (segment_bytes / link.bw + link.lat)


def flat_allreduce(nbytes: float, c: Cluster) -> float:
    """The flat ring over every rank; the slowest edge is the network when there are nodes."""
    link = c.net if c.nodes > 1 else c.intra
    return ring_allreduce(nbytes, c.size, link)


def _stages(nbytes: float, c: Cluster) -> Tuple[float, float]:
    """(intra-node time over the transport, inter-node time) of a two-level allreduce."""
    intra = ring_allreduce(nbytes, c.ranks_per_node, c.intra)
    inter = ring_allreduce(nbytes, c.nodes, c.net)
    return intra, inter


def hier_staged(nbytes: float, c: Cluster) -> float:
    """Reduce in the node, allreduce across nodes, broadcast in the node, in sequence."""
    if not c.hierarchical:
        return flat_allreduce(nbytes, c)
    intra, inter = _stages(nbytes, c)
    return intra + inter


def hier_pipelined(nbytes: float, c: Cluster, k: Constants = CONSTANTS) -> float:
    """Shared-memory stage and network stage pipelined over chunks of ``hier_chunk_bytes``."""
    if not c.hierarchical:
        return flat_allreduce(nbytes, c)
    if nbytes <= 0:
        return 0.0
    _, inter = _stages(nbytes, c)
    shm = k.shm_passes * nbytes / c.copy_bw
    chunks = max(1, math.ceil(nbytes / k.hier_chunk_bytes))
    ti, te = shm / chunks, inter / chunks
    return ti + te + (chunks - 1) * max(ti, te)


#: The formula of each algorithm of the knob table (tests/test_knob_table.py checks that
#: every one of its ALGORITHMS has one, and no other).
ALGORITHMS = {"flat": flat_allreduce, "hier_staged": hier_staged,
              "hier_pipelined": hier_pipelined}


def allreduce_time(algo: str, nbytes: float, c: Cluster) -> float:
    """Time of one allreduce of ``nbytes`` with the named algorithm: the engine's fixed
    cost once, plus the algorithm's wire time."""
    return c.op_s + ALGORITHMS[algo](nbytes, c)


def pack_buckets(grads: Sequence[Tuple[int, float]], cycle_s: float,
                 fusion_bytes: int) -> List[Tuple[float, int]]:
    """Fusion buffering: ``(packed_at, bytes)`` per buffer.

    A gradient ready at ``r`` is packed at the first cycle boundary at or after ``r``
    (``ceil(r / cycle) * cycle``); gradients packed at the same boundary share buffers of at
    most ``fusion_bytes`` (a gradient larger than that goes alone).
    """
    buckets: List[Tuple[float, int]] = []
    for nbytes, ready in sorted(grads, key=lambda g: g[1]):
        at = math.ceil(ready / cycle_s - 1e-9) * cycle_s if cycle_s > 0 else ready
        if (buckets and abs(buckets[-1][0] - at) < 1e-12 and fusion_bytes > 0
                and buckets[-1][1] + nbytes <= fusion_bytes):
            buckets[-1] = (at, buckets[-1][1] + nbytes)
        else:
            buckets.append((at, nbytes))
    return buckets


def schedule_buckets(buckets: Sequence[Tuple[float, int]], algo: str,
                     c: Cluster) -> List[Tuple[float, int]]:
    """``(done_at, bytes)`` per buffer: one allreduce on the wire at a time, in order."""
    free = 0.0
    out = []
    for at, nbytes in buckets:
        start = max(at, free)
        free = start + allreduce_time(algo, nbytes, c)
        out.append((free, nbytes))
    return out


def _update_after(done: Sequence[Tuple[float, int]], call_s: float, update_s: float,
                  overlap: bool) -> float:
    """End of the update: at once after the last buffer, or buffer by buffer (overlap)."""
    if not done:
        return call_s + update_s
    if not overlap:
        return max(call_s, max(t for t, _ in done)) + update_s
    total = sum(b for _, b in done) or 1
    free = call_s
    for at, nbytes in sorted(done):
        free = max(free, at) + update_s * nbytes / total
    return free


def dgc_exchange(numels: Sequence[int], c: Cluster, k: Constants = CONSTANTS) -> float:
    """Wire time of one DGC step: allgather of the sparse segments + dense small tensors."""
    sparse = [n for n in numels if n >= k.dgc_min_numel]
    dense_bytes = 4 * sum(n for n in numels if n < k.dgc_min_numel)
    segment = sum(4 + math.ceil(k.dgc_density * n) * (k.dgc_index_bytes + k.dgc_value_bytes)
                  for n in sparse)
    link = c.net if c.nodes > 1 else c.intra
    gather = c.op_s + ring_allgather(segment, c.size, link) if sparse else 0.0
    dense = allreduce_time("flat", dense_bytes, c) if dense_bytes else 0.0
    return gather + dense


def predict_step(cfg: Config, p: Profile, c: Cluster, k: Constants = CONSTANTS) -> float:
    """Predicted seconds per step of ``cfg`` (formulas in the module docstring)."""
    update = p.fused_update_s if cfg.fused and p.fused_update_s is not None else p.update_s
    if cfg.dgc:
        numels = p.grad_numels or [b // 4 for b, _ in p.grads]
        per_elem = (p.dgc_select_s_per_element if p.dgc_select_s_per_element is not None
                    else k.dgc_select_s_per_element)
        select = per_elem * sum(n for n in numels if n >= k.dgc_min_numel)
        return p.call_s + select + dgc_exchange(numels, c, k) + update
    if c.size <= 1:
        return p.call_s + update
    buckets = pack_buckets(p.grads, k.cycle_s, k.fusion_bytes)
    done = schedule_buckets(buckets, cfg.algo, c)
    return _update_after(done, p.call_s, update, cfg.overlap)


def configurations(c: Cluster, fused_available: bool) -> List[Config]:
    """The table's rows: each algorithm the cluster has x overlap x fused, then DGC (the
    values of the knob table's rows)."""
    algos = [a for a in ALLREDUCE_ALGORITHM.candidates if c.hierarchical or a == "flat"]
    out = []
    for algo in algos:
        for fused in (FUSED_OPTIMIZER.candidates if fused_available else (False,)):
            for overlap in OVERLAP_UPDATE.candidates:
                out.append(Config(algo, overlap, fused))
    out.append(Config(dgc=True))
    return out


def default_config(c: Cluster) -> Config:
    """What the job runs with no flag: ``AIAK_ALLREDUCE_ALGO=auto`` picks hier_pipelined
    where the layout has two levels (the cluster's ``hierarchical``), flat otherwise; no
    overlap, no fused optimizer, no compression."""
    return Config("hier_pipelined" if c.hierarchical else "flat")


def predict_table(p: Profile, c: Cluster, k: Constants = CONSTANTS
                  ) -> List[Tuple[Config, float, float]]:
    """``(config, predicted step s, speedup over the default configuration)`` for every row
    (:func:`default_config`; its own row has speedup 1)."""
    rows = [(cfg, predict_step(cfg, p, c, k))
            for cfg in configurations(c, p.fused_update_s is not None)]
    base = dict(rows)[default_config(c)]
    return [(cfg, t, base / t if t > 0 else float("inf")) for cfg, t in rows]


def with_network(c: Cluster, nodes: int, ranks_per_node: int, net: Link) -> Cluster:
    """The same nodes' insides on another layout and network (what-if)."""
    return replace(c, nodes=nodes, ranks_per_node=ranks_per_node, net=net)


__all__ = ["CONSTANTS", "Constants", "Link", "Cluster", "Profile", "Config", "ring_allreduce",
           "ring_allgather", "flat_allreduce", "hier_staged", "hier_pipelined",
           "allreduce_time", "pack_buckets", "schedule_buckets", "dgc_exchange",
           "predict_step", "configurations", "default_config", "predict_table", "with_network"]
