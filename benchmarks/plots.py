"""Draw every benchmark plot of the results pages from the JSON in benchmarks/results/.

Usage::

    python benchmarks/plots.py                 # writes docs/img/*.png
    python benchmarks/plots.py --out DIR       # somewhere else
    python benchmarks/plots.py --table         # also print the headline table (Markdown)

Needs matplotlib (``pip install -e '.[docs]'``).  Nothing here measures anything: each figure
is read from a JSON file that a benchmark script wrote, named in ``SOURCES`` below, so a plot
can always be traced back to the run and the command that produced it.
"""
import argparse
import glob
import json
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
DEFAULT_OUT = os.path.join(REPO, "docs", "img")

# Earlier spellings of the allreduce algorithms, as older JSON files record them.
ALGO_NAMES = {"horovod-hier": "hier_staged", "aiak-hier": "hier_pipelined"}

#: The headline figures: (ratio key, target, "min" or "max" meaning the target is a floor or a
#: ceiling, the JSON files (glob, under results/) whose median is the measured figure).  Only
#: ratios whose two sides use the same transport: not vs_gloo_ddp_buckets (MPICH against Gloo)
#: nor keras_fit_vs_mwms (MPICH against TensorFlow's gRPC collectives).
HEADLINE = [
    ("hier_vs_flat_64MB", 1.35, "min", "hier_2x2_1gbit_2026-11-23_run*.json"),
    ("hier_vs_horovod_hier_64MB", 1.10, "min", "hier_2x2_1gbit_2026-11-23_run*.json"),
    ("step_speedup_1gbit", 3.0, "min", "dgc_step_2x2_1gbit_2026-11-23_run*.json"),
    ("overlap_step_speedup_1gbit", 1.15, "min", "overlap_2026-11-23_run*.json"),
    ("adam_vs_torch_forloop_cpu", 3.0, "min", "fused_optim_2026-11-23.json"),
    ("sgd_vs_torch_foreach_cpu", 1.5, "min", "fused_optim_2026-11-23.json"),
]


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def files(pattern: str) -> List[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, pattern)))


def ratio_values(key: str, pattern: str) -> List[float]:
    out = []
    for name in files(pattern):
        value = load(name).get("ratios", {}).get(key)
        if value is not None:
            out.append(float(value))
    return out


def _plt():
    try:
        import matplotlib
    except ImportError:
        sys.exit("benchmarks/plots.py needs matplotlib: pip install -e '.[docs]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def _save(fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clear()
    return path


# ---- one function per figure ----------------------------------------------------------------
def plot_headline(plt, out: str) -> str:
    """Each headline ratio as a bar (median of its runs, whiskers: min and max) against its
    target; the figure of the README and of the Benchmarks page."""
    rows = []
    for key, target, _, pattern in HEADLINE:
        vals = ratio_values(key, pattern)
        if vals:
            rows.append((key, target, statistics.median(vals), min(vals), max(vals)))
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    ys = range(len(rows))
    meds = [r[2] for r in rows]
    err = [[r[2] - r[3] for r in rows], [r[4] - r[2] for r in rows]]
    colors = ["tab:green" if r[2] >= r[1] else "tab:orange" for r in rows]
    ax.barh(list(ys), meds, xerr=err, color=colors, alpha=0.85, capsize=3)
    ax.scatter([r[1] for r in rows], list(ys), marker="|", s=400, color="black", zorder=3,
               label="target")
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ratio against the baseline (above 1: aiak-training is better)")
    ax.set_title("Headline ratios: median of the recorded runs, min-max whiskers")
    ax.legend(loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, out, "headline.png")


def plot_hier(plt, out: str, name: str = "hier_2x2_1gbit_2026-11-23_run1.json") -> str:
    data = load(name)
    machine = data["machine"]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    by_algo: Dict[str, list] = {}
    for row in data["results"]:
        algo = ALGO_NAMES.get(row["params"]["algo"], row["params"]["algo"])
        by_algo.setdefault(algo, []).append(row)
    sizes = sorted({r["params"]["bytes"] for r in data["results"]})
    for algo in ("flat", "hier_staged", "hier_pipelined"):
        rows = sorted(by_algo.get(algo, []), key=lambda r: r["params"]["bytes"])
        ax.plot([r["params"]["bytes"] for r in rows], [r["params"]["busbw_gbs"] for r in rows],
                marker="o", label=algo)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes)
    ax.set_xticklabels([_human(s) for s in sizes], rotation=45)
    ax.set_xlabel("buffer size (fp32)")
    ax.set_ylabel("bus bandwidth, GB/s (bytes/t x 2(p-1)/p)")
    link = machine.get("link_gbit")
    if link:
        ax.axhline(link / 8, color="grey", ls=":", lw=1, label=f"measured link ({link:.3g} Gbit/s)")
    ax.set_title(f"allreduce on the emulated {machine['layout']} cluster, "
                 f"{machine.get('link_nominal_gbit', link):g} Gbit/s links")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, out, "hier_1gbit.png")


def plot_dgc_accuracy(plt, out: str, name: str = "dgc_digits_accuracy_2026-11-26.json") -> str:
    data = load(name)
    curves = data["digits_curves"]
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for variant, color in (("dense", "tab:blue"), ("dgc", "tab:red"), ("topk_no_feedback",
                                                                       "tab:grey")):
        per_seed = curves.get(variant)
        if not per_seed:
            continue
        runs = list(per_seed.values())
        n = min(len(c) for c in runs)
        mean = [statistics.mean(c[i] for c in runs) for i in range(n)]
        lo = [min(c[i] for c in runs) for i in range(n)]
        hi = [max(c[i] for c in runs) for i in range(n)]
        epochs = list(range(1, n + 1))
        ax.plot(epochs, mean, color=color, label=f"{variant} (mean of {len(runs)} seeds)")
        ax.fill_between(epochs, lo, hi, color=color, alpha=0.15)
    ax.set_ylim(40, 100)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy, %")
    ax.set_title("digits MLP, 4 ranks: dense allreduce vs DGC (density 0.001 after warm-up)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, out, "dgc_accuracy.png")


def _bars(plt, out: str, fname: str, title: str, groups: Sequence[str],
          series: Dict[str, List[float]], ylabel: str) -> str:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, values, width=width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    return _save(fig, out, fname)


def plot_dgc_step(plt, out: str) -> str:
    names = files("dgc_step_2x2_1gbit_2026-11-23_run*.json")
    dense, dgc = [], []
    for name in names:
        rows = {r["name"]: r["median_s"] for r in load(name)["results"]}
        dense.append(next(v for k, v in rows.items() if k.startswith("dense")) * 1e3)
        dgc.append(next(v for k, v in rows.items() if k.startswith("DGC")) * 1e3)
    return _bars(plt, out, "dgc_step.png",
                 "training step, 25M-parameter MLP, emulated 2x2 cluster at 1 Gbit/s",
                 [f"run {i + 1}" for i in range(len(names))],
                 {"dense DistributedOptimizer": dense, "DGC, density 0.001": dgc},
                 "median step time, ms")


def plot_overlap(plt, out: str) -> str:
    groups, sync, overlap = [], [], []
    for name in files("overlap_2026-11-23_run*.json"):
        run = name.rsplit("_run", 1)[1].split(".")[0]
        for cfg in load(name)["runs"]:
            rows = {r["name"]: r["median_s"] for r in cfg["results"]}
            groups.append(f"{'2x2, 1 Gbit/s' if cfg['config'] == 'emulated' else '1 node'}\nrun {run}")
            sync.append(rows["iteration sync (overlap_update=False)"] * 1e3)
            overlap.append(rows["iteration overlap (overlap_update=True)"] * 1e3)
    order = sorted(range(len(groups)), key=lambda i: groups[i])
    return _bars(plt, out, "overlap.png",
                 "training iteration, 25M-parameter Adam model",
                 [groups[i] for i in order],
                 {"overlap_update=False": [sync[i] for i in order],
                  "overlap_update=True": [overlap[i] for i in order]},
                 "median iteration time, ms")


def plot_fused_optim(plt, out: str) -> str:
    name = "fused_optim_2026-11-23.json"
    rows = {r["name"]: r["median_s"] * 1e3 for r in load(name)["results"]}
    pairs = [("Adam", "fused_adam", "torch_adam_fused", "torch_adam_forloop"),
             ("SGD momentum", "fused_sgd", None, "torch_sgd_foreach")]
    groups, ours, torch_fused, torch_plain = [], [], [], []
    for model in ("resnet50", "large"):
        for label, a, b, c in pairs:
            groups.append(f"{label}\n{model}")
            ours.append(rows[f"{model}/{a}"])
            torch_fused.append(rows[f"{model}/{b}"] if b else 0.0)
            torch_plain.append(rows[f"{model}/{c}"])
    return _bars(plt, out, "fused_optim.png", f"optimizer step on CPU ({name})", groups,
                 {"aiak fused": ours, "torch fused=True": torch_fused,
                  "torch for-loop (Adam) / foreach (SGD)": torch_plain},
                 "median step time, ms")


def plot_allreduce(plt, out: str) -> str:
    name = "allreduce_2ranks_2026-11-23_eve_final_run2.json"
    rows = {r["name"]: r["median_s"] * 1e3 for r in load(name)["results"]}
    keys = [k for k in ("raw_mpi_allreduce", "hvd_grouped_allreduce",
                        "hvd_grouped_allreduce_inplace", "gloo_ddp_buckets") if k in rows]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.barh(keys, [rows[k] for k in keys], color=["tab:grey", "tab:blue", "tab:blue", "tab:orange"][:len(keys)])
    ax.invert_yaxis()
    ax.set_xlabel("median ms for 25.6M fp32 values in 161 ResNet-50 tensors, 2 ranks")
    ax.set_title(f"allreduce of a ResNet-50 gradient set ({name})")
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, out, "allreduce_2ranks.png")


PLOTS = [plot_headline, plot_hier, plot_dgc_accuracy, plot_dgc_step, plot_overlap,
         plot_fused_optim, plot_allreduce]


def headline_table() -> str:
    lines = ["| ratio | target | median (min-max) | runs | JSON |", "|---|---|---|---|---|"]
    for key, target, kind, pattern in HEADLINE:
        vals = ratio_values(key, pattern)
        if not vals:
            continue
        lines.append(f"| `{key}` | {'>=' if kind == 'min' else '<='} {target:g} | "
                     f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f}) | "
                     f"{len(vals)} | `{pattern}` |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the PNGs (default docs/img)")
    p.add_argument("--table", action="store_true", help="print the headline table")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    plt = _plt()
    for fn in PLOTS:
        print("wrote", os.path.relpath(fn(plt, args.out), REPO))
    if args.table:
        print(headline_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
