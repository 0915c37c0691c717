"""aiak_training.tensorflow.keras on Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1), every rank.

Run at 2 ranks by tests/test_keras.py with TF_USE_LEGACY_KERAS=1 and AIAK_TEST_TMPDIR (a
directory the ranks share).  ``tf.keras`` is tf_keras here.  References: a single-process
Keras 2 run on the full data, numpy, or the formulas of Horovod's callbacks.
"""
import functools
import os

import numpy as np
import pytest
import tensorflow as tf

import aiak_training.keras as hvd_keras
import aiak_training.tensorflow.keras as hvd
from aiak_training.common import horovod_strings as hs
from keras_models import SAMPLES, dataset
import keras_models

keras = tf.keras
pytestmark = pytest.mark.skipif(not keras.__name__.startswith("tf_keras"),
                                reason="runs with TF_USE_LEGACY_KERAS=1 and tf_keras")


def shard(*arrays):
    return [a[hvd.rank()::hvd.size()] for a in arrays]


make_model = functools.partial(keras_models.make_model, keras)


def flat(variables):
    return np.concatenate([np.asarray(v).astype(np.float64).ravel() for v in variables])


def everyone(array):
    return hvd.allgather(np.asarray(array)[None]).numpy()


def assert_same_on_every_rank(array):
    gathered = everyone(array)
    for other in gathered[1:]:
        np.testing.assert_array_equal(gathered[0], other)


def fit(model, optimizer, x, y, batch_size, epochs, callbacks=()):
    model.compile(optimizer=optimizer, loss="mse")
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=list(callbacks))


def reference(make_optimizer, epochs, batch_size=SAMPLES):
    model = make_model()
    fit(model, make_optimizer(), *dataset(), batch_size=batch_size, epochs=epochs)
    return flat(model.get_weights())


def test_both_frontends_serve_keras2():
    import aiak_training.tensorflow as hvd_tf
    assert hvd_keras.DistributedOptimizer is hvd.DistributedOptimizer
    assert issubclass(hvd.callbacks.MetricAverageCallback, keras.callbacks.Callback)
    assert issubclass(hvd_keras.callbacks.BroadcastGlobalVariablesCallback,
                      keras.callbacks.Callback)
    # horovod.tensorflow's DistributedOptimizer hands Keras optimizers to the Keras one.
    sgd = keras.optimizers.SGD(0.1)
    wrapped = hvd_tf.DistributedOptimizer(sgd, backward_passes_per_step=2)
    assert isinstance(wrapped, type(sgd)) and hasattr(wrapped, "register_local_var")
    assert wrapped._aiak.aggregation.passes == 2


def test_fit_averages_like_one_process_new_and_legacy_optimizers():
    x, y = shard(*dataset())
    cases = [lambda: keras.optimizers.SGD(0.1, momentum=0.9),
             lambda: keras.optimizers.Adam(0.02),
             lambda: keras.optimizers.legacy.SGD(lr=0.1, momentum=0.9),  # Keras 2's lr=
             lambda: keras.optimizers.legacy.Adam(learning_rate=0.02)]
    for make_optimizer in cases:
        opt = hvd.DistributedOptimizer(make_optimizer())
        assert isinstance(opt, type(make_optimizer()))
        model = make_model()
        fit(model, opt, x, y, batch_size=len(x), epochs=3)
        weights = flat(model.get_weights())
        assert_same_on_every_rank(weights)
        np.testing.assert_allclose(weights, reference(make_optimizer, 3), rtol=1e-5, atol=1e-6)


def test_gradient_paths_and_options():
    me, n = hvd.rank(), hvd.size()
    var = tf.Variable([1.0, 2.0])
    loss = lambda: tf.reduce_sum(var * float(me + 1))  # noqa: E731
    mean = sum(r + 1 for r in range(n)) / n
    # _compute_gradients (legacy) and compute_gradients (Keras >= 2.11) return averages.
    legacy = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(1.0))
    grads = legacy._compute_gradients(loss, [var])
    np.testing.assert_allclose(grads[0][0].numpy(), [mean, mean])
    new = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)
    with tf.GradientTape() as tape:
        value = loss()
    grads = new.compute_gradients(value, [var], tape=tape)
    np.testing.assert_allclose(grads[0][0].numpy(), [mean * n, mean * n])
    new.minimize(loss, [var])
    np.testing.assert_allclose(var.numpy(), [1.0 - mean * n, 2.0 - mean * n], rtol=1e-6)
    for bad, message in [(dict(op=hvd.Adasum), hs.KERAS_OPS_SUPPORTED),
                         (dict(backward_passes_per_step=0), hs.BACKWARD_PASSES_POSITIVE),
                         (dict(op=hvd.Sum, gradient_predivide_factor=2.0),
                          hs.PREDIVIDE_NEEDS_AVERAGE)]:
        with pytest.raises(ValueError) as err:
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **bad)
        assert str(err.value) == message


def test_mixing_keras3_and_tf_keras_is_refused_naming_both():
    import keras as keras3
    with pytest.raises(ValueError, match=r"Keras 3\.\d+.*tf_keras 2\.\d+"):
        hvd.DistributedOptimizer(keras3.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"Keras 3\.\d+.*tf_keras 2\.\d+"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                        local_layers=[keras3.layers.Dense(2)])
    with pytest.raises(ValueError, match="tf.keras.layers.Layer"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[object()])


def test_backward_passes_per_step_and_sparse_as_dense():
    x, y = shard(*dataset())
    half = len(x) // 2
    for make_optimizer, average, lr in [(keras.optimizers.SGD, True, 0.1),
                                        (keras.optimizers.legacy.SGD, False, 0.05)]:
        opt = hvd.DistributedOptimizer(make_optimizer(lr), backward_passes_per_step=2,
                                       average_aggregated_gradients=average)
        model = make_model()
        fit(model, opt, x, y, batch_size=half, epochs=3)
        assert int(opt.iterations.numpy()) == 6  # every backward pass counts
        weights = flat(model.get_weights())
        assert_same_on_every_rank(weights)
        np.testing.assert_allclose(weights, reference(lambda: keras.optimizers.SGD(0.1), 3),
                                   rtol=1e-5, atol=1e-6)
    # An embedding's IndexedSlices gradient, reduced dense: rows each rank touched.
    me, n = hvd.rank(), hvd.size()
    emb = keras.layers.Embedding(n + 1, 2, embeddings_initializer="zeros")
    emb.build((None,))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), sparse_as_dense=True,
                                   op=hvd.Sum)
    opt.minimize(lambda: tf.reduce_sum(emb(tf.constant([me]))), emb.trainable_weights)
    expected = np.zeros((n + 1, 2), np.float32)
    expected[:n] = -1.0
    np.testing.assert_array_equal(emb.embeddings.numpy(), expected)


def test_partial_distributed_optimizer_keeps_local_layer_gradients():
    me, n = hvd.rank(), hvd.size()
    shared_layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    local_layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    inputs = keras.Input((1,))
    model = keras.Model(inputs, shared_layer(inputs) + local_layer(inputs))
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=local_layer)
    x = tf.constant([[float(me + 1)]])
    opt.minimize(lambda: tf.reduce_sum(model(x)), model.trainable_variables)
    mean = sum(r + 1 for r in range(n)) / n
    np.testing.assert_allclose(shared_layer.kernel.numpy(), [[-mean]], rtol=1e-6)
    np.testing.assert_allclose(local_layer.kernel.numpy(), [[-(me + 1) / n]], rtol=1e-6)


def test_callbacks_broadcast_metrics_and_warmup():
    me, n = hvd.rank(), hvd.size()
    x, y = shard(*dataset())
    model = make_model(seed=me)  # different start on every rank
    seen = {}

    class Record(keras.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            seen.setdefault("lr", []).append(float(keras.backend.get_value(
                self.model.optimizer.learning_rate)))

        def on_epoch_end(self, epoch, logs=None):
            seen.setdefault("loss", []).append(logs["loss"])

    steps, warmup, lr = 4, 2, 0.1
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(n - 1),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=warmup,
                                                          steps_per_epoch=steps),
                 Record()]
    history = fit(model, hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(lr)), x, y,
                  batch_size=len(x) // steps, epochs=3, callbacks=callbacks)
    assert_same_on_every_rank(flat(model.get_weights()))
    assert_same_on_every_rank(np.array(seen["loss"]))  # averaged over the ranks
    for epoch in range(warmup):
        for batch in range(steps):
            e = epoch + (batch + 1) / steps
            assert seen["lr"][epoch * steps + batch] == pytest.approx(
                lr / n * (e * (n - 1) / warmup + 1), rel=1e-6)
    assert history.history["lr"][-1] == pytest.approx(lr, rel=1e-6)


def test_load_model_and_broadcast_global_variables():
    me, n = hvd.rank(), hvd.size()
    path = os.path.join(os.environ.get("AIAK_TEST_TMPDIR", "/tmp"), "keras2_model.h5")
    if me == 0:
        # Named: default names count models, and the ranks must keep the same names.
        model = make_model(name="keras2_saved")
        model.compile(optimizer=keras.optimizers.legacy.SGD(0.1, momentum=0.9), loss="mse")
        model.fit(*dataset(), batch_size=SAMPLES, epochs=1, verbose=0)
        model.save(path)
        saved = flat(model.get_weights())
        del model
    else:
        saved = None
    hvd.allreduce(np.zeros(1), name="saved")  # the file exists before anyone reads it
    loaded = hvd.load_model(path, legacy_opts=True)
    assert type(loaded.optimizer).__mro__[1].__name__ == "_Distributed"
    if me == 0:
        np.testing.assert_array_equal(flat(loaded.get_weights()), saved)
    x, y = shard(*dataset())
    loaded.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
    assert_same_on_every_rank(flat(loaded.get_weights()))
    # broadcast_global_variables: every live model's weights, from the root.
    other = make_model(seed=10 + me, name="keras2_bgv")
    hvd.broadcast_global_variables(n - 1)
    np.testing.assert_array_equal(flat(other.get_weights()),
                                  flat(make_model(seed=10 + n - 1, name="ref_only").get_weights()))


def test_graph_mode_keras2_get_gradients_and_session_broadcast():
    """Keras 2 in a TF1 graph (its v1 training loop): the legacy optimizer's get_gradients
    combines the gradients, and broadcast_global_variables runs in Keras's session."""
    me = hvd.rank()
    x, y = shard(*dataset())
    graph = tf.Graph()
    with graph.as_default():
        model = make_model(seed=me, name="graph_mode_model")  # a different start per rank
        opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1))
        model.compile(optimizer=opt, loss="mse")
        hvd.broadcast_global_variables(0)
        start = flat(model.get_weights())
        model.fit(x, y, batch_size=len(x), epochs=3, shuffle=False, verbose=0)
        weights = flat(model.get_weights())
    assert_same_on_every_rank(start)
    assert_same_on_every_rank(weights)
    np.testing.assert_allclose(weights, reference(lambda: keras.optimizers.legacy.SGD(0.1), 3),
                               rtol=1e-5, atol=1e-6)
