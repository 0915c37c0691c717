"""Lightning 2 on aiak-training: step time against the plain DistributedOptimizer loop.

Figures (``ratios`` in the JSON; above 1 is better for the Lightning path):

* ``lightning_vs_plain_step``: the digits model's step time in the plain loop of
  examples/pytorch_digits.py (tensor indexing, ``DistributedOptimizer``) divided by its step
  time in ``Trainer(strategy=AiakStrategy())`` with the module of
  examples/lightning_digits.py.  Issue 42's target: the Lightning step within 10% of the
  plain one, i.e. >= 0.909.
* ``lightning_vs_plain_dataloader_step``: the same against the plain loop fed by the
  DataLoader and DistributedSampler Lightning uses: what Lightning's own loop costs beyond
  the data pipeline.

Each repetition trains ``--epochs`` epochs with each variant, alternating the variants in this
one launch; its figure is the wall time of epochs 2.. divided by their steps (epoch 1 is
warm-up).  ``--hidden`` widens the MLP's hidden layers (default: the digits model, 128,64).

    aiakrun -np 2 python benchmarks/lightning_bench.py --reps 7 \\
        --json benchmarks/results/lightning_2ranks_<date>.json
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import bench_common  # noqa: E402
import digits_data  # noqa: E402
from lightning_digits import DigitsModel, pl  # noqa: E402

import aiak_training.torch as hvd  # noqa: E402
from aiak_training.lightning import AiakStrategy  # noqa: E402

LR, MOMENTUM, BATCH = 0.05, 0.9, 32


def mlp(hidden):
    sizes = [64, *hidden, 10]
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def lightning_module(hidden):
    module = DigitsModel(LR * hvd.size(), MOMENTUM)
    module.net = mlp(hidden)
    return module


def per_step(epoch_times, steps):
    return statistics.median(t / steps for t in epoch_times[1:])


def plain(x, y, hidden, epochs):
    """pytorch_digits.py's loop: this rank's shard, indexed batches."""
    model = mlp(hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=MOMENTUM)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    steps = int(hvd.allreduce(torch.tensor(len(xs) // BATCH), op=hvd.Min))
    g = torch.Generator().manual_seed(hvd.rank())
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        order = torch.randperm(len(xs), generator=g)
        for step in range(steps):
            idx = order[step * BATCH:(step + 1) * BATCH]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            optimizer.step()
            loss.item()
        times.append(time.perf_counter() - start)
    return per_step(times, steps)


def plain_dataloader(x, y, hidden, epochs):
    """The same loop fed as Lightning feeds it: DataLoader + DistributedSampler."""
    model = mlp(hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=MOMENTUM)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    times = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            loss.item()
        times.append(time.perf_counter() - start)
    return per_step(times, len(loader))


class EpochClock(pl.Callback):
    def __init__(self):
        self.times, self.start = [], 0.0

    def on_train_epoch_start(self, trainer, module):
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, module):
        self.times.append(time.perf_counter() - self.start)


def lightning(x, y, hidden, epochs):
    clock = EpochClock()
    trainer = pl.Trainer(strategy=AiakStrategy(), accelerator="cpu", devices=1,
                         max_epochs=epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[clock])
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, drop_last=True)
    trainer.fit(lightning_module(hidden), loader)
    return per_step(clock.times, trainer.num_training_batches)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hidden", default="128,64")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    hidden = [int(h) for h in args.hidden.split(",")]
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x_train, _, y_train, _ = (torch.from_numpy(a) for a in digits_data.split(42))

    def variant(fn):
        return lambda: fn(x_train, y_train, hidden, args.epochs)

    times = bench_common.interleave({"plain": variant(plain),
                                     "plain_dataloader": variant(plain_dataloader),
                                     "lightning": variant(lightning)},
                                    reps=args.reps, warmup=args.warmup, rotate=True)
    if hvd.rank() != 0:
        return
    params = {"hidden": hidden, "batch_per_rank": BATCH, "epochs": args.epochs,
              "lightning": pl.__version__, "package": pl.__name__}
    results = [bench_common.summarize(name, params, samples) for name, samples in times.items()]
    median = {r["name"]: r["median_s"] for r in results}
    ratios = {"lightning_vs_plain_step": median["plain"] / median["lightning"],
              "lightning_vs_plain_dataloader_step":
                  median["plain_dataloader"] / median["lightning"]}
    machine = bench_common.machine_info(ranks=hvd.size())
    bench_common.report("lightning_bench", machine, results, ratios, args.json)


if __name__ == "__main__":
    main()
