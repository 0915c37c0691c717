"""What the digits examples share: their common options, the data split and the report.

Framework-free (argparse, numpy, scikit-learn).  The examples find it beside them when run as
``python examples/X.py`` (directly or under aiakrun), and all train on the same split, so
their accuracies can be compared (examples/digits_train.py, shipped to Ray and Spark workers
by value, keeps its own copy of the split).
"""
import argparse
import os
from typing import List, Tuple

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def parser(description: str) -> argparse.ArgumentParser:
    """The training hyper-parameters every digits example takes; each adds its own."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    return p


def elastic_args(description: str) -> argparse.Namespace:
    """The elastic examples' options: training hyper-parameters, then the commit interval
    and the demo aids (a pause per step, a progress file for a watcher)."""
    p = parser(description)
    p.add_argument("--batches-per-commit", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="pause after each step (to watch elastic events in a demo)")
    p.add_argument("--progress-file", default=os.environ.get("DIGITS_PROGRESS"),
                   help="rank 0 writes 'epoch step size' here after each commit")
    return p.parse_args()


def split(seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x_train, x_test, y_train, y_test: pixels scaled to [0, 1] (float32), labels int64,
    a quarter held out for testing, stratified by label."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)


def report(counts: List[int], total: int, rank: int, suffix: str = "") -> None:
    """Every rank evaluated the same test set and ``counts`` holds each rank's number of
    correct answers: they agree when the weights are in sync.  Rank 0 prints the accuracy
    (the line the tests read)."""
    assert len(set(counts)) == 1, f"ranks disagree: {counts}"
    if rank == 0:
        print(f"test accuracy: {100.0 * counts[0] / total:.2f}% ({counts[0]}/{total}){suffix}",
              flush=True)


def write_progress(path: str, epoch: int, step: int, size: int) -> None:
    """Replace ``path`` with 'epoch step size' in one rename, so a watcher never reads half
    a line."""
    with open(path + ".tmp", "w") as f:
        f.write(f"{epoch} {step} {size}\n")
    os.replace(path + ".tmp", path)
