"""Elastic training of the digits MLP (examples/pytorch_digits.py) with hvd.elastic: the job
keeps going when a host is lost and grows when the discovery script lists a new one.

    aiakrun -np 2 --min-np 1 --max-np 4 \\
        --host-discovery-script examples/elastic/discover_hosts.sh \\
        python examples/pytorch_digits_elastic.py

The discovery script prints the hosts that may run workers, ``hostname:slots`` per line
(examples/elastic/discover_hosts.sh reads them from a file you can edit while the job runs).
The training state (model, optimizer, sampler, epoch) is committed every
``--batches-per-commit`` steps; after a failure every rank goes back to the last commit,
and ranks that join receive it from rank 0.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import aiak_training.torch as hvd


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--batches-per-commit", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="pause after each step (to watch elastic events in a demo)")
    p.add_argument("--progress-file", default=os.environ.get("DIGITS_PROGRESS"),
                   help="rank 0 writes 'epoch step size' here after each commit")
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # several ranks share this machine's cores

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25,
                                                        random_state=args.seed, stratify=y)
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    # The sampler hands each rank its share of the samples not yet seen this epoch, so a
    # reset neither repeats nor skips samples.
    sampler = hvd.elastic.ElasticSampler(list(range(len(x_train))), shuffle=True,
                                         seed=args.seed)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=1, steps=0)

    def on_reset():
        # The world changed size: keep the learning rate proportional to it.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: now {hvd.size()} rank(s), resuming epoch {state.epoch}", flush=True)

    state.register_reset_callbacks([on_reset])

    def report_progress():
        if args.progress_file and hvd.rank() == 0:
            with open(args.progress_file + ".tmp", "w") as f:
                f.write(f"{state.epoch} {state.steps} {hvd.size()}\n")
            os.replace(args.progress_file + ".tmp", args.progress_file)

    @hvd.elastic.run
    def train(state):
        while state.epoch <= args.epochs:
            start = time.monotonic()
            model.train()
            batches = (len(state.sampler) + args.batch_size - 1) // args.batch_size
            for b in range(batches):
                idx = torch.tensor(state.sampler.get_indices(b, args.batch_size))
                optimizer.zero_grad()
                F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
                optimizer.step()
                state.sampler.record_batch(b, args.batch_size)
                state.steps += 1
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if state.steps % args.batches_per_commit == 0:
                    state.commit()
                    report_progress()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch:3d}/{args.epochs} on {hvd.size()} rank(s) "
                      f"{time.monotonic() - start:.2f}s", flush=True)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            report_progress()

    train(state)
    model.eval()
    with torch.no_grad():
        correct = int((model(x_test).argmax(1) == y_test).sum())
    accs = hvd.allgather_object(correct)
    assert len(set(accs)) == 1, f"ranks disagree: {accs}"
    if hvd.rank() == 0:
        print(f"test accuracy: {100.0 * correct / len(y_test):.2f}% "
              f"({correct}/{len(y_test)}) on {hvd.size()} rank(s)", flush=True)


if __name__ == "__main__":
    main()
