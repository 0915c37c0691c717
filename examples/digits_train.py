"""The digits training of examples/pytorch_digits.py as a function, for Ray and Spark.

``train()`` is a Horovod training function: it calls ``hvd.init()`` itself and runs on every
rank, however the ranks were started.  It does exactly what pytorch_digits.py does (same
seeds, shards, model, optimizer and steps), so every launcher reaches the same accuracy:

    aiakrun -np 2 python examples/digits_train.py          # MPI ranks
    python examples/ray_digits.py --num-workers 2          # Ray actors (RayExecutor.run)
    python examples/spark_digits.py --num-proc 2           # Spark tasks (aiak_training.spark.run)
"""
import argparse
import json
import time
from typing import Any, Dict, List


def train(epochs: int = 15, batch_size: int = 32, lr: float = 0.05, momentum: float = 0.9,
          seed: int = 42, verbose: bool = True) -> Dict[str, Any]:
    """Train on this rank's shard; returns the rank's test result and its step times."""
    # Imports inside: the function is shipped to Ray actors / Spark tasks by value.
    import numpy as np
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import aiak_training.torch as hvd

    hvd.init()
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # several ranks share this machine's cores

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25,
                                                        random_state=seed, stratify=y)
    x_train = torch.from_numpy(x_train[hvd.rank()::hvd.size()])
    y_train = torch.from_numpy(y_train[hvd.rank()::hvd.size()])
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    g = torch.Generator().manual_seed(seed + hvd.rank())
    steps = int(hvd.allreduce(torch.tensor(len(x_train) // batch_size), op=hvd.Min))
    step_times = []
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(len(x_train), generator=g)
        total = torch.zeros(2)
        for step in range(steps):
            start = time.perf_counter()
            idx = order[step * batch_size:(step + 1) * batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            step_times.append(time.perf_counter() - start)
            total += torch.tensor([loss.item() * len(idx), len(idx)])
        total = hvd.allreduce(total, op=hvd.Sum, name="epoch_loss")
        if verbose and hvd.rank() == 0:
            print(f"epoch {epoch:3d}/{epochs} loss {total[0] / total[1]:.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        correct = int((model(x_test).argmax(1) == y_test).sum())
    accs = hvd.allgather_object(correct)
    assert len(set(accs)) == 1, f"ranks disagree: {accs}"
    result = dict(rank=hvd.rank(), size=hvd.size(), correct=correct, total=len(y_test),
                  accuracy=correct / len(y_test), step_times=step_times,
                  gloo=hvd.gloo_enabled())
    if verbose and hvd.rank() == 0:
        print(f"test accuracy: {100.0 * correct / len(y_test):.2f}% ({correct}/{len(y_test)})",
              flush=True)
    return result


def summary(results: List[Dict[str, Any]], workers: str) -> str:
    """The line a launcher example prints for ``train``'s results (one per rank; they agree):
    how many ``workers`` trained and the accuracy they reached."""
    first = results[0]
    return (f"{first['size']} {workers}, test accuracy: {100.0 * first['accuracy']:.2f}% "
            f"({first['correct']}/{first['total']})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--json", help="rank 0 writes its result (accuracy, step times) here")
    args = p.parse_args()
    result = train(epochs=args.epochs)
    if args.json and result["rank"] == 0:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
