"""The elastic digits training (examples/pytorch_digits_elastic.py) on Ray, through the
elastic form of RayExecutor: the job keeps going when a Ray node is lost and grows onto nodes
that join.

    pip install -e '.[ray,examples]'
    python examples/ray_digits_elastic.py --min-workers 1 --max-workers 2   # a local Ray
    python examples/ray_digits_elastic.py --address auto --min-workers 2 --max-workers 8

Each Ray node offers one worker per --cpus-per-worker CPUs.  Arguments after ``--`` go to the
training script (e.g. ``-- --epochs 5 --step-sleep 0.05``).
"""
import argparse
import os
import sys

import cloudpickle
import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits_data  # noqa: E402
import pytorch_digits_elastic  # noqa: E402

from aiak_training.ray import RayExecutor  # noqa: E402


def train(argv):
    # The training script reads its options from the command line.
    sys.argv = ["pytorch_digits_elastic.py", *argv]
    pytorch_digits_elastic.main()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="Ray cluster address (default: start a local instance)")
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=None)
    p.add_argument("--cpus-per-worker", type=int, default=1)
    p.add_argument("--elastic-timeout", type=int, default=600)
    p.add_argument("script_args", nargs="*", help="options of pytorch_digits_elastic.py")
    args = p.parse_args()

    # The actors do not have examples/ on their path: ship the training code by value.
    cloudpickle.register_pickle_by_value(digits_data)
    cloudpickle.register_pickle_by_value(pytorch_digits_elastic)
    ray.init(address=args.address)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60),
                           min_workers=args.min_workers, max_workers=args.max_workers,
                           cpus_per_worker=args.cpus_per_worker,
                           elastic_timeout=args.elastic_timeout)
    executor.start()
    try:
        results = executor.run(train, args=[args.script_args])
    finally:
        executor.shutdown()
    print(f"finished on {len(results)} Ray worker(s)")


if __name__ == "__main__":
    main()
