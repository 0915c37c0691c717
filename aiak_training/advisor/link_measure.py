"""The advisor's link measurement, run as the job's program on the job's ranks and transport.

``python -m aiak_training.advisor.link_measure OUT.json``, launched by aiakrun with the job's own
flags.  Every collective goes through the engine, over MPI or Gloo as the job would:

* each pair of nodes: a two-rank allreduce between the nodes' first ranks, one pair at a time,
  of a small and a large message.  For two ranks the ring formula gives ``T = b/bw + 2 lat``,
  so ``lat = T_small / 2`` and ``bw = (b_large - b_small) / (T_large - T_small)``;
* inside node 0, the same between its first two ranks (when it has two);
* every rank's memory copy bandwidth, all ranks copying at once as the pipelined stage does;
* the engine's fixed cost of one collective (``op_s``): a 4-byte allreduce over all the ranks
  with the job's own algorithm.  The model charges it once per collective; the pairs' small
  messages cannot split it from the wire's latency (both are in ``T_small``), and taking the
  slowest of several noisy pairs would inflate it.

Rank 0 writes the results as JSON.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from itertools import combinations
from typing import Any, Dict, List

SMALL_BYTES = 4
LARGE_BYTES = 8 * 1024 * 1024
COPY_BYTES = 64 * 1024 * 1024
SMALL_REPS = 15
LARGE_REPS = 3


def _timed(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _pair_link(hvd: Any, ranks: List[int], name: str) -> Dict[str, float]:
    """Fit (bw, lat) of a two-rank allreduce; every rank calls this, only ``ranks`` work."""
    import torch
    whole = len(ranks) == hvd.size()  # the global set already holds exactly these ranks
    pset = hvd.global_process_set if whole else hvd.add_process_set(ranks)
    result: Dict[str, float] = {}
    if hvd.rank() in ranks:
        small = torch.zeros(SMALL_BYTES // 4)
        large = torch.zeros(LARGE_BYTES // 4)

        def run(t: Any, tag: str) -> None:
            hvd.allreduce(t, name=f"advise.{name}.{tag}", process_set=pset)

        run(small, "w")
        run(large, "w")  # first use: connections and buffers
        t_small = _timed(lambda: run(small, "s"), SMALL_REPS)
        t_large = _timed(lambda: run(large, "l"), LARGE_REPS)
        lat = t_small / 2
        bw = (LARGE_BYTES - SMALL_BYTES) / max(t_large - t_small, 1e-9)
        result = {"bw": bw, "lat": lat}
    hvd.barrier()
    if not whole:
        hvd.remove_process_set(pset)
    return result


def _op_cost(hvd: Any) -> float:
    """Median time of a 4-byte allreduce over every rank (all ranks call this)."""
    import torch
    small = torch.zeros(SMALL_BYTES // 4)
    hvd.allreduce(small, name="advise.op.w")
    hvd.barrier()
    return _timed(lambda: hvd.allreduce(small, name="advise.op"), SMALL_REPS)


def _copy_bw() -> float:
    import torch
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return COPY_BYTES / _timed(lambda: dst.copy_(src), 3)


def measure(hvd: Any) -> Dict[str, Any]:
    """Every rank calls this after ``hvd.init()``; the dict is complete on rank 0."""
    layout = hvd.allgather_object((hvd.rank(), hvd.cross_rank(), hvd.local_rank()))
    nodes: Dict[int, List[int]] = {}
    for rank, node, _ in sorted(layout, key=lambda r: (r[1], r[2])):
        nodes.setdefault(node, []).append(rank)
    order = sorted(nodes)
    links = []
    for a, b in combinations(order, 2):
        got = _pair_link(hvd, [nodes[a][0], nodes[b][0]], f"net{a}_{b}")
        links.append(hvd.broadcast_object({"nodes": [a, b], **got},
                                          root_rank=nodes[a][0]))
    intra = None
    first = nodes[order[0]]
    if len(first) > 1:
        got = _pair_link(hvd, first[:2], "intra")
        intra = hvd.broadcast_object(got, root_rank=first[0])
    op_s = hvd.broadcast_object(_op_cost(hvd), root_rank=0)
    hvd.barrier()
    copies = hvd.allgather_object(_copy_bw())
    return {
        "nodes": len(order),
        "ranks_per_node": min(len(r) for r in nodes.values()),
        "ranks_per_node_all": [len(nodes[n]) for n in order],
        "links": links,
        "intra": intra,
        "copy_bw": statistics.median(copies),
        "op_s": op_s,
        "gloo": bool(hvd.gloo_enabled()),
    }


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m aiak_training.advisor.link_measure OUT.json\n")
        return 2
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    import aiak_training.torch as hvd
    hvd.init()
    result = measure(hvd)
    if hvd.rank() == 0:
        with open(argv[0] + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f)
        os.replace(argv[0] + ".tmp", argv[0])
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
