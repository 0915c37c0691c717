"""From the measurements to the printed table: build the model's inputs, rank the rows."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from aiak_training.advisor.model import (CONSTANTS, Cluster, Config, Link, Profile,
                                         default_config, predict_table, with_network)
from aiak_training.advisor.whatif import WhatIf
from aiak_training.common.tuning import DGC, FUSED_OPTIMIZER, OVERLAP_UPDATE

#: A lossless configuration must beat the job's default configuration by this much to be
#: recommended (the gain rule): a smaller predicted gain is inside the model's error.
MIN_GAIN = 1.02
#: A switch (``overlap_update``, a fused optimizer) is recommended only if the configuration
#: with it is predicted this much faster than the same configuration without it.  Below
#: that the difference is smaller than the model's own error (its target is 15%), and a
#: switch that gains nothing measurable still costs the user a change and something to debug.
MIN_SWITCH_GAIN = 1.05


def cluster_from_measurement(measured: Dict[str, Any]) -> Cluster:
    """The measured cluster; the slowest node pair's bandwidth stands for the network (a
    ring runs at its slowest edge).

    With ``op_s`` (the all-rank 4-byte allreduce) the links get no per-step latency: the
    measured small-collective time already holds the engine's cost and every wire hop, and
    the model charges it once per collective.  Without it (an older measurement), each link keeps
    its pair's latency and the model charges it per ring step."""
    intra = measured.get("intra")
    links = measured.get("links") or []
    copy_bw = float(measured["copy_bw"])
    op_s = measured.get("op_s")
    keep = op_s is None
    # One rank per node: no in-node pair to measure; memory copies stand in for it.
    intra_link = Link(intra["bw"], intra["lat"] if keep else 0.0) if intra \
        else Link(copy_bw, 0.0)
    if links:
        net = Link(min(x["bw"] for x in links),
                   max(x["lat"] for x in links) if keep else 0.0)
    else:
        net = intra_link
    return Cluster(nodes=int(measured["nodes"]), ranks_per_node=int(measured["ranks_per_node"]),
                   net=net, intra=intra_link, copy_bw=copy_bw, gloo=bool(measured.get("gloo")),
                   op_s=float(op_s or 0.0))


def apply_what_if(c: Cluster, w: WhatIf, measured_net: bool) -> Cluster:
    """The hypothetical cluster: its layout and link; per-step latency from ``latency_us``,
    else the measured network's (none beyond the measured per-collective cost, which is
    kept), else :data:`CONSTANTS.default_latency_s` when the job ran on one node.  With
    ``intra_gbit`` the in-node link (its measured latency kept) and the memory copy rate of
    the hierarchical stages are that bandwidth instead of the measured ones."""
    if w.latency_us is not None:
        lat = w.latency_us * 1e-6
    else:
        lat = c.net.lat if measured_net else CONSTANTS.default_latency_s
    out = with_network(c, w.nodes, w.ranks_per_node, Link(w.link_bytes_per_s, lat))
    intra = w.intra_bytes_per_s
    if intra is not None:
        out = replace(out, intra=Link(intra, c.intra.lat), copy_bw=intra)
    return out


def cluster_sources(w: WhatIf, measured_net: bool) -> List[str]:
    """Where each part of a what-if cluster came from (given for the target, or measured
    here), for the report's header."""
    lat = ("latency_us" if w.latency_us is not None else
           "measured here" if measured_net else "the default, no latency_us")
    return [f"layout and network: given (nodes, ranks_per_node, link_gbit); latency: {lat}",
            "in-node link and memory copy: " + (f"{w.intra_gbit:g} Gbit/s given (intra_gbit)"
                                                if w.intra_gbit is not None
                                                else "measured here"),
            "per-collective cost: measured here"]


def profile_from_ranks(docs: Sequence[Dict[str, Any]]) -> Profile:
    """The slowest rank's profile: the step waits for it."""
    doc = max(docs, key=lambda d: d["call_s"] + d["update_s"])
    return Profile(grads=[(int(b), float(r)) for b, r in doc["grads"]],
                   call_s=float(doc["call_s"]), update_s=float(doc["update_s"]),
                   fused_update_s=doc.get("fused_update_s"),
                   grad_numels=[int(n) for n in doc.get("numels", [])])


def _switches(cfg: Config) -> int:
    return int(cfg.overlap) + int(cfg.fused)


def _fewer_switches(cfg: Config, other: Config) -> bool:
    """Whether ``other`` is ``cfg`` with one or more of its switches turned off."""
    return (other.algo == cfg.algo and not other.dgc and other != cfg
            and other.overlap <= cfg.overlap and other.fused <= cfg.fused)


def recommend(rows: Sequence[Tuple[Config, float, float]], default: Config
              ) -> Tuple[Config, float]:
    """The fastest lossless row, with every switch that does not gain ``MIN_SWITCH_GAIN``
    turned off again (the switch rule); ``default`` when that does not beat it by
    ``MIN_GAIN`` (the gain rule).  Returns the row and its speedup over ``default``."""
    lossless = [r for r in rows if not r[0].dgc]
    best = min(lossless, key=lambda r: r[1])
    simpler = [r for r in lossless if _fewer_switches(best[0], r[0])
               and r[1] < best[1] * MIN_SWITCH_GAIN]
    if simpler:
        best = min(simpler, key=lambda r: (_switches(r[0]), r[1]))
    times = dict((cfg, t) for cfg, t, _ in rows)
    # Another algorithm than the default's must also earn its flag (the gain rule again).
    same_switches = replace(best[0], algo=default.algo)
    if best[0].algo != default.algo and same_switches in times and \
            times[same_switches] < best[1] * MIN_GAIN:
        best = (same_switches, times[same_switches], 0.0)
    default_t = times[default]
    gain = default_t / best[1] if best[1] > 0 else float("inf")
    return (best[0], gain) if best[0] != default and gain >= MIN_GAIN else (default, 1.0)


def rules_applied(rows: Sequence[Tuple[Config, float, float]], best: Config,
                  default: Config) -> List[str]:
    """Why the row predicted fastest, when it is not ``best``, was passed over: the rule that
    applied to each way it differs (its algorithm, its switches)."""
    lossless = [r for r in rows if not r[0].dgc]
    fastest, fastest_t, _ = min(lossless, key=lambda r: r[1])
    if fastest == best:
        return []
    rules = []
    if (fastest.overlap, fastest.fused) != (best.overlap, best.fused):
        rules.append(f"the switch rule ({OVERLAP_UPDATE.flag} and {FUSED_OPTIMIZER.flag} are "
                     f"recommended only where predicted at least "
                     f"{(MIN_SWITCH_GAIN - 1) * 100:.0f}% faster than the same row without them)")
    if fastest.algo != best.algo:
        rules.append(f"the gain rule (a change from the default, its algorithm included, is "
                     f"recommended only where predicted at least {(MIN_GAIN - 1) * 100:.0f}% "
                     f"faster than without it)")
    best_t = dict((cfg, t) for cfg, t, _ in rows)[best]
    return [f"({fastest.name} is predicted {best_t / fastest_t:.3f}x the recommendation's "
            f"speed, within the model's error; passed over by {' and '.join(rules)})"]


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB/s"


def format_table(p: Profile, c: Cluster, *, what_if: Optional[WhatIf] = None,
                 links: Sequence[Dict[str, Any]] = (), optimizer: str = "",
                 sources: Sequence[str] = ()) -> str:
    """The advisor's report: inputs, where they came from (``sources``), one row per
    configuration, the recommendation."""
    rows = predict_table(p, c)
    default = default_config(c)
    best, gain = recommend(rows, default)
    out: List[str] = []
    title = "what-if" if what_if else "measured"
    out.append(f"aiakrun --advise ({title}): {c.nodes} node(s) x {c.ranks_per_node} rank(s), "
               f"{'Gloo' if c.gloo else 'MPI'}")
    out.append(f"  network {_gb(c.net.bw)}, latency {c.net.lat * 1e3:.3g} ms; in-node "
               f"{_gb(c.intra.bw)}, {c.intra.lat * 1e3:.3g} ms; memory copy {_gb(c.copy_bw)}")
    out.append(f"  per-collective cost {c.op_s * 1e3:.3g} ms (a 4-byte allreduce over all "
               "ranks; charged once per collective)")
    for link in links:
        a, b = link["nodes"]
        out.append(f"  measured link node {a} <-> node {b}: {_gb(link['bw'])}, "
                   f"small message {2 * link['lat'] * 1e3:.3g} ms")
    fused = ("n/a" if p.fused_update_s is None else f"{p.fused_update_s * 1e3:.3g} ms")
    out.append(f"  model: {len(p.grads)} gradient tensor(s), {p.total_bytes / 1e6:.3g} MB; "
               f"compute {p.call_s * 1e3:.3g} ms/step; update {p.update_s * 1e3:.3g} ms "
               f"({optimizer or 'optimizer'}), fused {fused}")
    for line in sources:
        out.append(f"  taken from: {line}")
    out.append("")
    out.append(f"  {'configuration':<32}{'step (ms)':>11}{'speedup':>9}  flags to add "
               f"(speedup over the default, {default.name})")
    for cfg, t, speedup in rows:
        name = cfg.name + (" (default)" if cfg == default else "") + \
            (" [changes numerics]" if cfg.dgc else "")
        mark = "*" if cfg == best else " "
        flags = cfg.flags_over(default) or "none: the default"
        out.append(f"{mark} {name:<32}{t * 1e3:>11.2f}{speedup:>8.2f}x  {flags}")
    out.append("")
    if best != default:
        out.append(f"recommendation: {best.name}, predicted {gain:.2f}x the default's speed: "
                   f"add {best.flags_over(default)} to the aiakrun command (before the "
                   f"training command)")
    else:
        out.append(f"recommendation: {best.name}, the default: no flag needed")
    out += rules_applied(rows, best, default)
    dgc = [r for r in rows if r[0].dgc][0]
    if dgc[1] < min(r[1] for r in rows if not r[0].dgc):
        out.append(f"DGC is predicted faster ({dgc[2]:.2f}x) but changes the numerics; it is "
                   f"never switched on for you: opt in with {DGC.script} after checking "
                   "accuracy (docs/dgc.md)")
    else:
        out.append("DGC (changes the numerics) is not predicted to beat the lossless options")
    if not c.hierarchical:
        why = ("the Gloo transport has no hierarchical allreduce" if c.gloo and c.nodes > 1
               and c.ranks_per_node > 1 else "one node or one rank per node")
        out.append(f"(hier_staged and hier_pipelined are left out: {why})")
    return "\n".join(out)
