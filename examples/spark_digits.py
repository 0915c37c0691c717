"""The digits training (examples/digits_train.py) in Spark tasks, through
aiak_training.spark.run.

    pip install -e '.[spark,examples]'
    python examples/spark_digits.py --num-proc 2                   # Spark local[4]
    spark-submit --master spark://host:7077 examples/spark_digits.py --num-proc 8

The ranks run in Spark tasks (barrier execution mode) and talk over aiak_training's Gloo
mode.  The accuracy is the same as `aiakrun -np 2 python examples/pytorch_digits.py`.
"""
import argparse
import os
import sys

import cloudpickle
from pyspark import SparkConf
from pyspark.sql import SparkSession

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits_train  # noqa: E402

import aiak_training.spark  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--master", default=None,
                   help="Spark master when not run by spark-submit (default local[4])")
    p.add_argument("--epochs", type=int, default=15)
    args = p.parse_args()

    # The tasks do not have examples/ on their path: ship the training code by value.
    cloudpickle.register_pickle_by_value(digits_train)
    builder = SparkSession.builder.appName("aiak-training digits")
    if args.master:
        builder = builder.master(args.master)
    elif not SparkConf().contains("spark.master"):  # spark-submit sets one
        builder = builder.master("local[4]")
    spark = builder.getOrCreate()
    try:
        results = aiak_training.spark.run(digits_train.train, kwargs=dict(epochs=args.epochs),
                                          num_proc=args.num_proc)
    finally:
        spark.stop()
    print(digits_train.summary(results, "Spark tasks"))


if __name__ == "__main__":
    main()
