"""The digits training (examples/digits_train.py) on Ray actors, through RayExecutor.

    pip install -e '.[ray,examples]'
    python examples/ray_digits.py --num-workers 2              # a local Ray instance
    python examples/ray_digits.py --address auto --num-hosts 2 --workers-per-host 2

The ranks are the Ray actors: one MPI world where MPICH is installed, else Gloo worlds
(AIAK_RAY_TRANSPORT=mpi|gloo chooses).  The accuracy is the same
as `aiakrun -np 2 python examples/pytorch_digits.py` (same seeds, shards and steps).
"""
import argparse
import os
import sys

import cloudpickle
import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits_train  # noqa: E402

from aiak_training.ray import RayExecutor  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="Ray cluster address (default: start a local instance)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--num-hosts", type=int, help="place --workers-per-host on each of N nodes")
    p.add_argument("--workers-per-host", type=int, default=1)
    p.add_argument("--epochs", type=int, default=15)
    args = p.parse_args()

    # The actors do not have examples/ on their path: ship the training code by value.
    cloudpickle.register_pickle_by_value(digits_train)
    ray.init(address=args.address)
    settings = RayExecutor.create_settings(timeout_s=60)
    if args.num_hosts:
        executor = RayExecutor(settings, num_hosts=args.num_hosts,
                               num_workers_per_host=args.workers_per_host)
    else:
        executor = RayExecutor(settings, num_workers=args.num_workers)
    executor.start()
    try:
        results = executor.run(digits_train.train, kwargs=dict(epochs=args.epochs,
                                                               verbose=False))
    finally:
        executor.shutdown()
    print(digits_train.summary(results, "Ray workers"))


if __name__ == "__main__":
    main()
