"""Elastic Keras training of the digits MLP (examples/keras_digits.py) with hvd.elastic:
``model.fit`` keeps going when a host is lost and grows when the discovery script lists a
new one.

    aiakrun -np 2 --min-np 1 --max-np 4 \\
        --host-discovery-script examples/elastic/discover_hosts.sh \\
        python examples/keras_digits_elastic.py

The model and optimizer live in ``hvd.elastic.KerasState`` with the epoch and batch
counters; the callbacks commit every ``--batches-per-commit`` batches and keep the
counters current, and ``fit`` resumes at ``state.epoch`` after a reset.  Runs on the
TensorFlow or the torch Keras backend.
"""
import os
import random
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import aiak_training.keras as hvd  # noqa: E402
import digits_data  # noqa: E402  (beside this file: the shared options and data split)


class _Pause(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


class _Progress(keras.callbacks.Callback):
    def __init__(self, state, path, every):
        super().__init__()
        self.state, self.path, self.every = state, path, every

    def on_batch_end(self, batch, logs=None):
        if (batch + 1) % self.every == 0 and hvd.rank() == 0:
            digits_data.write_progress(self.path, self.state.epoch, batch, hvd.size())


def main():
    args = digits_data.elastic_args(__doc__)
    hvd.init()
    random.seed(args.seed)
    np.random.seed(args.seed)
    if keras.backend.backend() == "tensorflow":
        keras.utils.set_random_seed(args.seed)

    x_train, x_test, y_train, y_test = digits_data.split(args.seed)
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=args.momentum))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def on_reset():
        optimizer.learning_rate.assign(args.lr * hvd.size())
        if hvd.rank() == 0:
            print(f"reset: now {hvd.size()} rank(s), resuming at epoch {state.epoch}",
                  flush=True)

    state.register_reset_callbacks([on_reset])
    callbacks = [hvd.callbacks.MetricAverageCallback(),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit)]
    if args.step_sleep:
        callbacks.append(_Pause(args.step_sleep))
    if args.progress_file:
        callbacks.append(_Progress(state, args.progress_file, args.batches_per_commit))

    @hvd.elastic.run
    def train(state):
        # The shard depends on the current world; all ranks run the same number of steps.
        steps = len(x_train) // hvd.size() // args.batch_size
        xs = x_train[hvd.rank()::hvd.size()][:steps * args.batch_size]
        ys = y_train[hvd.rank()::hvd.size()][:steps * args.batch_size]
        state.model.fit(xs, ys, batch_size=args.batch_size, shuffle=True,
                        epochs=args.epochs - state.epoch, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)

    train(state)
    predictions = np.argmax(keras.ops.convert_to_numpy(model.predict(x_test, verbose=0)), 1)
    correct = int((predictions == y_test).sum())
    counts = keras.ops.convert_to_numpy(hvd.allgather(np.array([correct]))).tolist()
    digits_data.report(counts, len(y_test), hvd.rank(), f" on {hvd.size()} rank(s)")


if __name__ == "__main__":
    main()
