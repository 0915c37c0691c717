"""Train a small MLP on scikit-learn's bundled digits data with aiak_training.

A Horovod script, unchanged except for the import line:

    aiakrun -np 2 python examples/pytorch_digits.py
    mpiexec -n 2 python examples/pytorch_digits.py
"""
import time

import torch
import torch.nn.functional as F

import aiak_training.torch as hvd
import digits_data  # beside this file: the options, data split and report of all examples


def parse_args():
    p = digits_data.parser(__doc__)
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression")
    p.add_argument("--use-adasum", action="store_true",
                   help="combine the ranks' updates with Adasum instead of averaging (the "
                        "learning rate is then not scaled by the number of ranks)")
    p.add_argument("--cuda", action="store_true",
                   help="train on GPUs, one per rank (torch.cuda.set_device(hvd.local_rank()))")
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()
    device = torch.device("cpu")
    if args.cuda:  # one GPU per rank, as in Horovod's examples
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # several ranks share this machine's cores

    x_train, x_test, y_train, y_test = digits_data.split(args.seed)
    # Each rank trains on its own shard.
    x_train = torch.from_numpy(x_train[hvd.rank()::hvd.size()]).to(device)
    y_train = torch.from_numpy(y_train[hvd.rank()::hvd.size()]).to(device)
    x_test, y_test = torch.from_numpy(x_test).to(device), torch.from_numpy(y_test).to(device)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).to(device)
    # Scale the learning rate by the number of ranks, as Horovod recommends (not with
    # Adasum, which adds orthogonal updates and averages parallel ones by itself).
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                                momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} rank(s), {len(x_train)} samples per rank, "
              f"{args.epochs} epochs", flush=True)
    g = torch.Generator().manual_seed(args.seed + hvd.rank())
    # Every rank must run the same number of steps.
    steps = int(hvd.allreduce(torch.tensor(len(x_train) // args.batch_size), op=hvd.Min))
    for epoch in range(1, args.epochs + 1):
        start = time.monotonic()
        model.train()
        order = torch.randperm(len(x_train), generator=g).to(device)
        total = torch.zeros(2, device=device)
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(idx), len(idx)], device=device)
        total = hvd.allreduce(total, op=hvd.Sum, name="epoch_loss")
        if hvd.rank() == 0:
            bar = "#" * int(30 * epoch / args.epochs)
            print(f"epoch {epoch:3d}/{args.epochs} [{bar:<30}] "
                  f"loss {total[0] / total[1]:.4f}  {time.monotonic() - start:.2f}s", flush=True)

    model.eval()
    with torch.no_grad():
        correct = (model(x_test).argmax(1) == y_test).sum()
    # Every rank evaluated the same test set; check they agree (parameters are in sync).
    digits_data.report(hvd.allgather_object(int(correct)), len(y_test), hvd.rank())


if __name__ == "__main__":
    main()
