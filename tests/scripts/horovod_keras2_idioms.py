"""A Horovod TensorFlow 2 script in Keras 2's idioms, as Horovod's own examples are written.

Run by tests/test_horovod_keras2.py under ``aiakrun --horovod-compat``: ``import horovod``
resolves to the shim.  The idioms: ``hvd.DistributedOptimizer`` around a
``tf.keras.optimizers`` instance with ``compile(experimental_run_tf_function=False)``, and
``hvd.broadcast_variables(opt.variables(), ...)`` inside a ``tf.function``.  Prints each
rank's final weights.
"""
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

hvd.init()
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(16, 3)).astype("float32")
y = x.sum(axis=1, keepdims=True)

model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)),
              experimental_run_tf_function=False)
model.fit(x, y, batch_size=4, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

opt = tf.optimizers.SGD(0.01, momentum=0.9)


@tf.function
def step(first_batch):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    tape = hvd_tf.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd_tf.broadcast_variables(model.variables, root_rank=0)
        hvd_tf.broadcast_variables(opt.variables(), root_rank=0)


step(True)
step(False)
weights = np.concatenate([np.asarray(v).ravel() for v in model.weights])
print("rank %d keras %s weights %s" % (hvd.rank(), tf.keras.__name__.split(".")[0],
                                       weights.round(6).tolist()), flush=True)
