"""aiak_training.keras on every rank, on the Keras backend of the process (TensorFlow or
torch).

Run at 2 ranks by tests/test_keras.py, once per backend (KERAS_BACKEND), with
AIAK_TEST_TMPDIR naming a directory all ranks share.  References are computed here: a
single-process Keras run on the full data, numpy, or the formulas of Horovod's callbacks.
Every ``model.fit`` traces a train function (seconds on TensorFlow), so each test runs few
of them and checks much on each.
"""
import functools
import importlib.util
import os
import sys

import keras
import numpy as np
import pytest

import aiak_training.keras as hvd
from aiak_training.common import horovod_strings as hs
from keras_models import SAMPLES, dataset
import keras_models

BACKEND = keras.backend.backend()
TENSORFLOW = BACKEND == "tensorflow"


def to_numpy(value):
    return keras.ops.convert_to_numpy(value)


def everyone(array):
    """Every rank's ``array``, stacked in rank order."""
    return to_numpy(hvd.allgather(np.asarray(array)[None]))


def shard(*arrays):
    return [a[hvd.rank()::hvd.size()] for a in arrays]


make_model = functools.partial(keras_models.make_model, keras)


def flat(variables):
    return np.concatenate([to_numpy(v).astype(np.float64).ravel() for v in variables])


def assert_same_on_every_rank(array):
    gathered = everyone(array)
    for other in gathered[1:]:
        np.testing.assert_array_equal(gathered[0], other)


def fit(model, optimizer, x, y, batch_size, epochs, callbacks=(), compile_args=None,
        **fit_args):
    model.compile(optimizer=optimizer, loss="mse", **(compile_args or {}))
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=list(callbacks), **fit_args)


def reference(optimizer, epochs, batch_size=SAMPLES):
    """Weights after training one process on all the data (the full batch by default)."""
    model = make_model()
    fit(model, optimizer, *dataset(), batch_size=batch_size, epochs=epochs)
    return flat(model.weights)


# ---- DistributedOptimizer -----------------------------------------------------------------
def test_wrapper_is_the_optimizers_class_and_checks_options():
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(sgd)
    assert isinstance(opt, type(sgd)) and type(opt) is not type(sgd)
    assert type(opt).__name__ == type(sgd).__name__
    assert opt.get_config() == sgd.get_config()
    assert hvd.DistributedOptimizer(opt).get_config() == sgd.get_config()  # rewrapping
    for bad, message in [(dict(op=hvd.Adasum), hs.KERAS_OPS_SUPPORTED),
                         (dict(backward_passes_per_step=0), hs.BACKWARD_PASSES_POSITIVE),
                         (dict(groups=-1), hs.GROUPS_TYPE_TF),
                         (dict(op=hvd.Sum, gradient_predivide_factor=2.0),
                          hs.PREDIVIDE_NEEDS_AVERAGE)]:
        with pytest.raises(ValueError) as err:
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **bad)
        assert str(err.value) == message
    with pytest.warns(DeprecationWarning):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=2)
    # A built optimizer's state is carried over; variables() works as in Keras 2.
    adam = keras.optimizers.Adam(0.01)
    v = keras.Variable(np.ones(3, np.float32))
    adam.apply([keras.ops.convert_to_tensor(np.ones(3, np.float32))], [v])
    wrapped = hvd.DistributedOptimizer(adam)
    assert wrapped.built and int(to_numpy(wrapped.iterations)) == 1
    np.testing.assert_array_equal(flat(wrapped.variables()), flat(adam.variables))


def test_fit_averages_gradients_like_one_process_on_the_full_batch():
    x, y = shard(*dataset())
    # Grouped as lists of variables (the rest alone) and in 2 operations; the other tests
    # send all gradients in one.
    cases = [(lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              lambda model: {"groups": [[model.weights[0], model.weights[3]]]}),
             (lambda: keras.optimizers.Adam(0.02), lambda model: {"groups": 2})]
    for make_optimizer, options in cases:
        model = make_model()
        fit(model, hvd.DistributedOptimizer(make_optimizer(), **options(model)), x, y,
            batch_size=len(x), epochs=3)
        weights = flat(model.weights)
        assert_same_on_every_rank(weights)
        np.testing.assert_allclose(weights, reference(make_optimizer(), 3), rtol=1e-5,
                                   atol=1e-6)


def test_backward_passes_per_step_sums_locally_and_applies_every_n():
    x, y = shard(*dataset())
    half = len(x) // 2
    for average, lr in [(True, 0.1), (False, 0.05)]:
        model = make_model()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=2,
                                       average_aggregated_gradients=average)
        fit(model, opt, x, y, batch_size=half, epochs=3)
        assert int(to_numpy(opt.iterations)) == 6  # every backward pass counts
        weights = flat(model.weights)
        assert_same_on_every_rank(weights)
        # Two half batches summed (and averaged, or at half the rate) make one full batch.
        np.testing.assert_allclose(weights, reference(keras.optimizers.SGD(0.1), 3),
                                   rtol=1e-5, atol=1e-6)
    # Called by hand: nothing moves on the first pass, the sum of both on the second.
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    var = keras.Variable(np.zeros(3, np.float32))
    grad = keras.ops.convert_to_tensor(np.full(3, hvd.rank() + 1.0, np.float32))
    opt.apply([grad], [var])
    np.testing.assert_array_equal(to_numpy(var), np.zeros(3))
    opt.apply([grad], [var])
    mean = np.mean([2.0 * (r + 1) for r in range(hvd.size())])
    np.testing.assert_array_equal(to_numpy(var), np.full(3, -mean, np.float32))
    assert int(to_numpy(opt.iterations)) == 2


@pytest.mark.skipif(not TENSORFLOW, reason="sparse gradients come from TensorFlow")
def test_sparse_gradients_of_an_embedding():
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 20, size=(SAMPLES, 3))
    y = rng.normal(size=(SAMPLES, 1)).astype(np.float32)

    def model_and_weights():
        model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                  keras.layers.Embedding(20, 4), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        wrng = np.random.default_rng(3)
        model.set_weights([wrng.normal(size=w.shape).astype(np.float32)
                           for w in model.get_weights()])
        return model

    model = model_and_weights()
    sx, sy = shard(ids, y)
    fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), sx, sy,
        batch_size=len(sx), epochs=2)
    ref = model_and_weights()
    fit(ref, keras.optimizers.SGD(0.1), ids, y, batch_size=SAMPLES, epochs=2)
    assert_same_on_every_rank(flat(model.weights))
    np.testing.assert_allclose(flat(model.weights), flat(ref.weights), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError) as err:
        fit(model_and_weights(), hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                          backward_passes_per_step=2),
            sx, sy, batch_size=len(sx), epochs=1)
    assert hs.SPARSE_WITH_BACKWARD_PASSES in str(err.value)


# ---- callbacks ------------------------------------------------------------------------------
class Recorder(keras.callbacks.Callback):
    """What the optimizer holds at each batch's start and end, and the epochs' logs."""

    def __init__(self):
        super().__init__()
        self.lr, self.momentum, self.momentum_after, self.logs = [], [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lr.append(float(to_numpy(self.model.optimizer.learning_rate)))
        self.momentum.append(float(getattr(self.model.optimizer, "momentum", 0.0)))

    def on_train_batch_end(self, batch, logs=None):
        self.momentum_after.append(float(getattr(self.model.optimizer, "momentum", 0.0)))

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


def expected_momentum(new_lrs, initial_lr, momentum=0.9):
    """Momentum correction's values: momentum * new_lr / old_lr, with old_lr read back
    from the optimizer's float32 variable."""
    out, old = [], float(np.float32(initial_lr))
    for new in new_lrs:
        out.append(momentum * new / old)
        old = float(np.float32(new))
    return out


def test_learning_rate_warmup_callback():
    x, y = shard(*dataset())
    size, lr, warmup, steps, epochs = hvd.size(), 0.4, 2, 4, 3
    recorder = Recorder()
    history = fit(make_model(), hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)),
                  x, y, batch_size=len(x) // steps, epochs=epochs,
                  callbacks=[hvd.callbacks.LearningRateWarmupCallback(lr, warmup), recorder])
    # lr(epoch) = lr / size * (epoch * (size - 1) / warmup + 1), epoch counted in batches
    # and shifted by one batch; nothing changes after the warmup.
    wanted = [lr * (1.0 / size * ((e + b / steps + 1.0 / steps) * (size - 1) / warmup + 1))
              for e in range(warmup) for b in range(steps)]
    assert recorder.lr == [float(np.float32(v)) for v in wanted] + [recorder.lr[-1]] * steps
    assert recorder.lr[-1] == float(np.float32(lr))
    assert recorder.momentum == expected_momentum(wanted, lr) + [0.9] * steps
    assert recorder.momentum_after == [0.9] * (epochs * steps)
    assert history.history["lr"] == [recorder.lr[steps - 1], recorder.lr[-1], recorder.lr[-1]]


def test_learning_rate_schedule_callback():
    x, y = shard(*dataset())
    steps = 4
    # Staircase, a constant multiplier, epochs [1, 3): changed at each epoch's first batch.
    recorder = Recorder()
    schedule = hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1, end_epoch=3)
    fit(make_model(), hvd.DistributedOptimizer(keras.optimizers.SGD(0.3, momentum=0.9)), x, y,
        batch_size=len(x) // steps, epochs=4, callbacks=[schedule, recorder])
    per_epoch = [0.3, 0.1, 0.05, 0.05]
    assert recorder.lr == [float(np.float32(v)) for v in per_epoch for _ in range(steps)]
    corrected = expected_momentum([0.1, 0.05], 0.3)
    assert recorder.momentum == ([0.9] * steps + [corrected[0]] + [0.9] * (steps - 1)
                                 + [corrected[1]] + [0.9] * (2 * steps - 1))
    assert [log["lr"] for log in recorder.logs] == [float(np.float32(v)) for v in per_epoch]
    # Per batch with a function of the fractional epoch; steps per epoch from fit.
    recorder = Recorder()
    schedule = hvd.callbacks.LearningRateScheduleCallback(
        0.1, lambda epoch: 1.0 / (1.0 + epoch), staircase=False, momentum_correction=False)
    fit(make_model(), hvd.DistributedOptimizer(keras.optimizers.Adam(0.3)), x, y,
        batch_size=len(x) // steps, epochs=2, callbacks=[schedule, recorder])
    assert recorder.lr == [float(np.float32(0.1 * (1.0 / (1.0 + (e + b / steps)))))
                           for e in range(2) for b in range(steps)]
    with pytest.raises(ValueError) as err:
        hvd.callbacks.LearningRateScheduleCallback(None, 0.5)
    assert str(err.value) == hs.INITIAL_LR_REQUIRED


class MomentumSwitch(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.momentum = 0.9 if batch % 2 == 0 else 0.2


def test_momentum_changes_reach_the_compiled_step():
    # Keras 3 keeps momentum as a float, which a traced TensorFlow step would freeze; the
    # wrapper makes changes (momentum correction) take effect as in an eager step.
    x, y = shard(*dataset())
    results = []
    for eager in (True, False):
        model = make_model()
        fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), x, y,
            batch_size=len(x) // 4, epochs=2, compile_args={"run_eagerly": eager},
            callbacks=[MomentumSwitch()])
        results.append(flat(model.weights))
    # Eager and graph kernels round differently; a frozen momentum is off by ~1e-1.
    np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-5)


def test_metric_average_callback_averages_logs_exactly():
    x, y = shard(*dataset())
    vx, vy = shard(*dataset(seed=1))
    raw, averaged = Recorder(), Recorder()
    history = fit(make_model(), hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), x, y,
                  batch_size=len(x) // 2, epochs=2, compile_args={"metrics": ["mae"]},
                  validation_data=(vx, vy),
                  callbacks=[raw, hvd.callbacks.MetricAverageCallback(), averaged])
    names = sorted(raw.logs[0])
    assert {"loss", "mae", "val_loss", "val_mae"} <= set(names)
    for epoch in range(2):
        mine = np.array([raw.logs[epoch][n] for n in names], np.float64)
        gathered = everyone(mine)
        assert not np.array_equal(gathered[0], gathered[1])  # the ranks did differ
        mean = gathered.mean(axis=0)
        assert [averaged.logs[epoch][n] for n in names] == mean.tolist()
        assert [history.history[n][epoch] for n in names] == mean.tolist()


def test_broadcast_global_variables_callback():
    x, y = shard(*dataset())
    model = make_model(seed=hvd.rank())  # every rank starts elsewhere
    # Left out of the broadcast; its gradient is still averaged, so it keeps its offset.
    local = model.layers[-1].bias
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[local])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    fit(model, opt, x, y, batch_size=len(x) // 4, epochs=1, callbacks=[callback])
    assert callback.broadcast_done
    shared = [w for w in model.weights if w is not local]
    assert_same_on_every_rank(flat(shared))
    assert_same_on_every_rank(flat(opt.variables))
    biases = everyone(to_numpy(local))
    assert not np.array_equal(biases[0], biases[1])  # the local variable kept its own value
    with pytest.raises(ValueError) as err:
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=["not a variable"])
    assert str(err.value) == hs.LOCAL_VARIABLES_TYPE


def test_broadcast_global_variables():
    a = make_model(seed=hvd.rank(), name="aiak_global_a")
    b = make_model(seed=10 + hvd.rank(), name="aiak_global_b")
    a.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    a.optimizer.build(a.trainable_variables)
    a.optimizer.iterations.assign(5 + hvd.rank())
    hvd.broadcast_global_variables(0)
    for model, seed in [(a, 0), (b, 10)]:
        np.testing.assert_array_equal(flat(model.weights), flat(make_model(seed).weights))
    assert int(to_numpy(a.optimizer.iterations)) == 5
    assert_same_on_every_rank(flat(a.optimizer.variables))
    twin = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)], name="aiak_global_a")
    with pytest.raises(ValueError, match="two live Keras models are both named"):
        hvd.broadcast_global_variables(0)
    del twin


# ---- values, frameworks, saving ---------------------------------------------------------------
def test_collectives_on_values():
    rank, size = hvd.rank(), hvd.size()
    assert to_numpy(hvd.allreduce(np.array([rank + 1.0]))).tolist() == [(size + 1) / 2]
    total = hvd.allreduce(rank + 1.0, op=hvd.Sum)
    assert to_numpy(total).dtype == np.float32 and float(to_numpy(total)) == size * (size + 1) / 2
    assert to_numpy(hvd.allreduce(np.float64(rank), postscale_factor=2.0)).item() == size - 1
    assert to_numpy(hvd.allgather(np.array([[rank]] * (rank + 1)))).ravel().tolist() == \
        [r for r in range(size) for _ in range(r + 1)]
    assert to_numpy(hvd.broadcast(np.array([rank, rank]), 0)).tolist() == [0, 0]
    scattered = hvd.reducescatter(np.arange(2.0 * size) * (rank + 1), op=hvd.Sum)
    factor = size * (size + 1) / 2
    assert to_numpy(scattered).tolist() == [2 * rank * factor, (2 * rank + 1) * factor]


def test_only_the_backends_framework_is_loaded():
    # Saving (next test) makes Keras itself import TensorFlow, so this comes first.
    other = "torch" if TENSORFLOW else "tensorflow"
    assert other not in sys.modules, f"{other} was imported on the {BACKEND} backend"


class CustomSGD(keras.optimizers.SGD):
    """An optimizer class of the user's own (not registered with Keras)."""


def test_load_model_round_trip():
    directory = os.environ["AIAK_TEST_TMPDIR"]
    x, y = shard(*dataset())
    for cls, path in [(keras.optimizers.SGD, f"{directory}/{BACKEND}_sgd.keras"),
                      (CustomSGD, f"{directory}/{BACKEND}_custom.keras")]:
        model = make_model()
        fit(model, hvd.DistributedOptimizer(cls(0.1, momentum=0.9)), x, y,
            batch_size=len(x) // 2, epochs=1)
        if hvd.rank() == 0:
            model.save(path)
        hvd.allreduce(np.zeros(1), name="keras_model_saved")  # the file is there for all
        loaded = hvd.load_model(path, custom_optimizers=[cls])
        assert isinstance(loaded.optimizer, cls) and hasattr(loaded.optimizer,
                                                             "register_local_var")
        np.testing.assert_array_equal(flat(loaded.weights), flat(model.weights))
        np.testing.assert_array_equal(flat(loaded.optimizer.variables),
                                      flat(model.optimizer.variables))
        # Both go on alike, in step on every rank.
        for m in (model, loaded):
            m.fit(x, y, batch_size=len(x) // 2, epochs=1, shuffle=False, verbose=0)
        np.testing.assert_allclose(flat(loaded.weights), flat(model.weights), rtol=1e-6)
        assert_same_on_every_rank(flat(loaded.weights))
    # Saved under the plain class's name: Keras alone loads the plain optimizer.
    plain = keras.models.load_model(f"{directory}/{BACKEND}_sgd.keras")
    assert not hasattr(plain.optimizer, "register_local_var")
    assert isinstance(plain.optimizer, keras.optimizers.SGD)


def test_partial_distributed_optimizer_keeps_local_layer_gradients():
    me, n = hvd.rank(), hvd.size()
    shared_layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    local_layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    inputs = keras.Input((1,))
    model = keras.Model(inputs, keras.layers.Add()([shared_layer(inputs), local_layer(inputs)]))
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=local_layer)
    # d(mean prediction)/d(kernel) = x = rank + 1 for both kernels.
    model.compile(optimizer=opt, loss=lambda y_true, y_pred: keras.ops.mean(y_pred))
    model.fit(np.array([[me + 1.0]], np.float32), np.zeros((1, 1), np.float32), batch_size=1,
              epochs=1, verbose=0)
    mean = sum(r + 1 for r in range(n)) / n
    np.testing.assert_allclose(to_numpy(shared_layer.kernel), [[-mean]], rtol=1e-6)
    np.testing.assert_allclose(to_numpy(local_layer.kernel), [[-(me + 1) / n]], rtol=1e-6)
    with pytest.raises(ValueError, match="tf.keras.layers.Layer"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[object()])
    if TENSORFLOW and importlib.util.find_spec("tf_keras") is not None:
        import tf_keras
        with pytest.raises(ValueError, match=r"tf_keras 2\.\d+.*Keras 3\.\d+"):
            hvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.1))
