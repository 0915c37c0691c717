"""Train a small MLP on scikit-learn's digits data with Keras 3's ``model.fit`` and
aiak_training.keras, on the TensorFlow or the torch backend:

    aiakrun -np 2 python examples/keras_digits.py
    KERAS_BACKEND=torch aiakrun -np 2 python examples/keras_digits.py

A Horovod Keras script, unchanged except for the import line (``import horovod.keras as
hvd`` / ``horovod.tensorflow.keras`` also run as they are with ``aiakrun --horovod-compat``).
The data, split and model are those of examples/pytorch_digits.py.
"""
import os
import random

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter

import keras  # noqa: E402
import numpy as np  # noqa: E402

import aiak_training.keras as hvd  # noqa: E402
import digits_data  # noqa: E402  (beside this file: options, data split and report)


def parse_args():
    p = digits_data.parser(__doc__)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression")
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)  # Keras draws its default initializer seeds from Python's generator
    np.random.seed(seed)
    if keras.backend.backend() == "tensorflow":
        # Also TensorFlow's seed (fit's shuffling); on torch this would import TensorFlow.
        keras.utils.set_random_seed(seed)


def main():
    args = parse_args()
    hvd.init()
    seed_everything(args.seed + hvd.rank())  # each rank shuffles differently

    x_train, x_test, y_train, y_test = digits_data.split(args.seed)
    # Each rank trains on its own shard, cut to a whole number of batches that is the same
    # on every rank (all ranks must run the same number of steps).
    steps = len(x_train) // hvd.size() // args.batch_size
    x_train = x_train[hvd.rank()::hvd.size()][:steps * args.batch_size]
    y_train = y_train[hvd.rank()::hvd.size()][:steps * args.batch_size]

    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    # Scale the learning rate by the number of ranks, as Horovod recommends; the warmup
    # callback starts from lr / size and reaches it after --warmup-epochs.
    scaled_lr = args.lr * hvd.size()
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=scaled_lr, momentum=args.momentum),
        compression=compression)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        # Rank 0's initial weights and optimizer state go to every rank.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Logged loss and accuracy are averaged over the ranks.
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                                 warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    if hvd.rank() == 0:
        print(f"training on {hvd.size()} rank(s) with Keras {keras.__version__} "
              f"({keras.backend.backend()} backend), {len(x_train)} samples per rank, "
              f"{args.epochs} epochs", flush=True)
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)

    predictions = np.argmax(keras.ops.convert_to_numpy(model.predict(x_test, verbose=0)), 1)
    correct = int((predictions == y_test).sum())
    # Every rank evaluated the same test set; they agree when the weights are in sync.
    counts = keras.ops.convert_to_numpy(hvd.allgather(np.array([correct]))).tolist()
    digits_data.report(counts, len(y_test), hvd.rank())


if __name__ == "__main__":
    main()
