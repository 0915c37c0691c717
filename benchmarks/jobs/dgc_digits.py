"""DGC against dense training on scikit-learn's digits data: the per-rank training code of the
convergence test (tests/parallel/test_dgc_convergence.py) and of benchmarks/dgc_bench.py's
plot mode.

Same MLP, global batch, epochs, learning-rate schedule and seeds for every variant:

* ``dense``: ``hvd.DistributedOptimizer`` with momentum SGD (the baseline);
* ``dgc``: the same with ``compression=hvd.Compression.dgc(density=0.001)`` and the paper's
  warm-up over the first 4 epochs;
* ``topk_no_ef``: top-k at the same densities but *without* error feedback: each rank sends
  the top-k of its current gradient and drops the rest, and momentum is applied after the
  exchange.  Built here from the library's selection and exchange primitives.

The seeds' models are trained side by side, one model per seed in one ``ModuleList``, one
optimizer, one exchange per step.  They stay independent runs: DGC selects, accumulates and
masks per tensor, so no tensor of one seed's model affects another's (no weight decay, no
clipping here), and each seed has its own data split, shuffling and initialisation.  Sharing
the exchange only saves the per-step communication latency, which dominates on 2 shared
cores.

Needs ``hvd.init()`` first; ``AIAK_DGC_DIGITS_EPOCHS`` sets the default number of epochs (30).
"""
import math
import os
from typing import Dict, List, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import aiak_training.torch as hvd
from aiak_training.dgc import DensitySchedule, select_topk, sparse_allgather_async

EPOCHS = int(os.environ.get("AIAK_DGC_DIGITS_EPOCHS", "30"))
SEEDS = (0, 1, 2)
PER_RANK_BATCH = 16
LR = 0.05
MOMENTUM = 0.9
DENSITY = 0.001
WARMUP_EPOCHS = 4
VARIANTS = ("dense", "dgc", "topk_no_ef")


def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed,
                                              stratify=y)
    return (torch.from_numpy(x_tr), torch.from_numpy(y_tr),
            torch.from_numpy(x_te), torch.from_numpy(y_te))


def make_model(seed: int) -> torch.nn.Module:
    """64-128-64-10 MLP: compressed weights of 8192, 8192 and 640 elements (k = 9, 9, 1)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


class _TopkNoErrorFeedback:
    """Plain top-k exchange of the current gradients (no residual), then local momentum SGD."""

    def __init__(self, models, opt, schedule: DensitySchedule):
        params = [p for m in models for p in m.parameters()]
        self.big = [p for p in params if p.dim() > 1]
        self.small = [p for p in params if p.dim() <= 1]
        self.opt, self.schedule = opt, schedule

    def start(self, step: int) -> None:
        density = self.schedule(step)
        indices, values = [], []
        for p in self.big:
            g = p.grad.reshape(-1)
            idx, _ = select_topk(g, max(1, math.ceil(density * g.numel())))
            indices.append(idx)
            values.append(g.index_select(0, idx.long()))  # everything else is dropped
        self.sparse = sparse_allgather_async(indices, values, name="topk_no_ef")
        self.dense = hvd.grouped_allreduce_async([p.grad for p in self.small], name="topk_no_ef")

    def finish(self) -> None:
        outs = [p.grad.view(-1) for p in self.big]
        for o in outs:
            o.zero_()
        self.sparse.finish(outs)
        for o in outs:
            o.div_(hvd.size())
        for p, s in zip(self.small, hvd.synchronize(self.dense)):
            p.grad.copy_(s)
        self.opt.step()


def train_digits(variants: Sequence[str] = VARIANTS, seeds: Sequence[int] = SEEDS,
                 epochs: int = EPOCHS) -> Dict[str, Dict[int, List[float]]]:
    """Train every (variant, seed) pair; returns the test accuracy (percent) after every
    epoch, as ``curves[variant][seed]``.

    All pairs train side by side, one model each: one backward pass over the sum of their
    losses (each model's gradient depends on its own term only), then every variant's
    exchange, all in flight together.  Each variant has its own optimizer; DGC selects,
    accumulates and masks per tensor, so models do not affect each other (no weight decay or
    clipping here).  Sharing the steps only saves per-step communication latency, which
    dominates on 2 shared cores.
    """
    data = {s: load_data(s) for s in seeds}
    n_ranks, rank = hvd.size(), hvd.rank()
    global_batch = PER_RANK_BATCH * n_ranks
    steps_per_epoch = data[seeds[0]][0].shape[0] // global_batch
    total_steps = epochs * steps_per_epoch
    density_schedule = DensitySchedule(DENSITY, warmup_epochs=WARMUP_EPOCHS,
                                       steps_per_epoch=steps_per_epoch)
    models, opts, scheds = {}, {}, []
    topk = None
    for variant in variants:
        models[variant] = torch.nn.ModuleList([make_model(s) for s in seeds])
        named = [(f"{variant}.{n}", p) for n, p in models[variant].named_parameters()]
        base = torch.optim.SGD(models[variant].parameters(), lr=LR, momentum=MOMENTUM)
        if variant == "dense":
            opt = hvd.DistributedOptimizer(base, named_parameters=named)
        elif variant == "dgc":
            opt = hvd.DistributedOptimizer(
                base, named_parameters=named,
                compression=hvd.Compression.dgc(density=DENSITY, warmup_epochs=WARMUP_EPOCHS,
                                                steps_per_epoch=steps_per_epoch, min_numel=0))
        elif variant == "topk_no_ef":
            opt = base
            topk = _TopkNoErrorFeedback(models[variant], opt, density_schedule)
        else:
            raise ValueError(variant)
        opts[variant] = opt
        scheds.append(torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))))
    curves: Dict[str, Dict[int, List[float]]] = {v: {s: [] for s in seeds} for v in variants}
    step = 0
    for epoch in range(epochs):
        perms = {s: torch.randperm(data[s][0].shape[0], generator=torch.Generator().manual_seed(
            1000 * s + epoch)) for s in seeds}
        for b in range(steps_per_epoch):
            lo = b * global_batch + rank * PER_RANK_BATCH
            for opt in opts.values():
                opt.zero_grad()
            loss = 0.0
            for variant in variants:
                for s, model in zip(seeds, models[variant]):
                    rows = perms[s][lo: lo + PER_RANK_BATCH]
                    loss = loss + F.cross_entropy(model(data[s][0][rows]), data[s][1][rows])
            loss.backward()
            if topk is not None:
                topk.start(step)
            for variant in variants:
                if variant != "topk_no_ef":
                    opts[variant].step()
            if topk is not None:
                topk.finish()
            for sched in scheds:
                sched.step()
            step += 1
        with torch.no_grad():
            for variant in variants:
                for s, model in zip(seeds, models[variant]):
                    x_te, y_te = data[s][2], data[s][3]
                    acc = (model(x_te).argmax(1) == y_te).float().mean().item()
                    curves[variant][s].append(100.0 * acc)
    return curves
