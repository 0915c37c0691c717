"""Train a small MLP on scikit-learn's digits data with a TensorFlow 2 custom training loop
(``tf.function`` step, ``hvd.DistributedGradientTape``) and aiak_training.tensorflow:

    aiakrun -np 2 python examples/tensorflow2_digits.py

A Horovod TensorFlow 2 script, unchanged except for the import line.  The data, split and
model are those of examples/pytorch_digits.py; the model and optimizer are Keras 3's.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
os.environ["KERAS_BACKEND"] = "tensorflow"  # the loop below is TensorFlow code

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import aiak_training.tensorflow as hvd  # noqa: E402
import digits_data  # noqa: E402  (beside this file: options, data split and report)


def parse_args():
    p = digits_data.parser(__doc__)
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression")
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)  # ranks share this machine
    keras.utils.set_random_seed(args.seed + hvd.rank())  # each rank shuffles differently

    x_train, x_test, y_train, y_test = digits_data.split(args.seed)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    # Every rank must run the same number of steps.
    steps = int(hvd.allreduce(tf.constant(len(x_train) // args.batch_size), op=hvd.Min))
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shuffle(len(x_train), seed=args.seed + hvd.rank())
               .batch(args.batch_size, drop_remainder=True).take(steps))

    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    # Scale the learning rate by the number of ranks, as Horovod recommends.
    optimizer = keras.optimizers.SGD(learning_rate=args.lr * hvd.size(),
                                     momentum=args.momentum)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)

    @tf.function
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        # The tape averages the gradients over the ranks.
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} rank(s), {steps * args.batch_size} samples per "
              f"rank, {args.epochs} epochs", flush=True)
    for epoch in range(1, args.epochs + 1):
        total = tf.zeros([])
        for images, labels in dataset:
            total += train_step(images, labels)
        mean_loss = hvd.allreduce(total / steps, name="epoch_loss")  # averaged over ranks
        if hvd.rank() == 0:
            print(f"epoch {epoch:3d}/{args.epochs} loss {float(mean_loss):.4f}", flush=True)

    predictions = np.argmax(model(x_test, training=False).numpy(), 1)
    correct = int((predictions == y_test).sum())
    # Every rank evaluated the same test set; they agree when the weights are in sync.
    counts = hvd.allgather(tf.constant([correct])).numpy().tolist()
    digits_data.report(counts, len(y_test), hvd.rank())


if __name__ == "__main__":
    main()
