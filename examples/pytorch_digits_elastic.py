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
import time

import torch
import torch.nn.functional as F

import aiak_training.torch as hvd
import digits_data  # beside this file: the shared options and data split


def main():
    args = digits_data.elastic_args(__doc__)
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # several ranks share this machine's cores

    x_train, x_test, y_train, y_test = digits_data.split(args.seed)
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
            digits_data.write_progress(args.progress_file, state.epoch, state.steps, hvd.size())

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
    digits_data.report(hvd.allgather_object(correct), len(y_test), hvd.rank(),
                       f" on {hvd.size()} rank(s)")


if __name__ == "__main__":
    main()
