"""``backward_passes_per_step`` > 1 under Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1) with both
optimizer families tf_keras ships: the current ones (``tf.keras.optimizers.SGD``, ...) and
``tf.keras.optimizers.legacy.*``.  Every rank runs this file (tests/test_fidelity_issue30.py
launches it at 2 ranks).

The gradients are chosen so that their sums and averages are exact in float32 (multiples of
the world size, small dyadic values), and every expected value is computed here from the
loss formulas, not by the code under test.  Calls are spelled as code written for Horovod
spells them: ``opt._compute_gradients(loss, var_list=...)`` then ``opt.apply_gradients``,
and ``opt._agg_helper.counter``.
"""
import numpy as np
import pytest
import tensorflow as tf

import aiak_training.tensorflow.keras as hvd
from aiak_training.common import horovod_strings as hs

keras = tf.keras
pytestmark = pytest.mark.skipif(not keras.__name__.startswith("tf_keras"),
                                reason="runs with TF_USE_LEGACY_KERAS=1 and tf_keras")

PASSES = 4
FAMILIES = {
    "SGD": (lambda: keras.optimizers.SGD(1.0), lambda: keras.optimizers.legacy.SGD(1.0)),
    "RMSprop": (lambda: keras.optimizers.RMSprop(0.01),
                lambda: keras.optimizers.legacy.RMSprop(0.01)),
    "Adam": (lambda: keras.optimizers.Adam(0.01), lambda: keras.optimizers.legacy.Adam(0.01)),
}
# (optimizer, family index: 0 current, 1 legacy)
CASES = [(name, k) for name in FAMILIES for k in (0, 1)]


def case_id(case):
    return f"{case[0]}-{'legacy' if case[1] else 'current'}"


def coefficients(rank, t):
    """The gradients of pass ``t`` on ``rank``: d/dx and d/dy[0], d/dy[2] (dy[1] is 0)."""
    n = hvd.size()
    return (np.array([n * (rank + 1 + t), n * (0.5 * t - rank)], np.float32),
            np.array([n * (t - 2 * rank), n * 1.5], np.float32))


def dense(cx, cy):
    return np.concatenate([cx, [cy[0], 0.0, cy[1]]]).astype(np.float32)


def split(flat):
    return flat[:2], flat[2:]


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_aggregated_sums_are_exact_and_applied_every_n_passes(case, in_function):
    name, legacy = case
    make = FAMILIES[name][legacy]
    average = name == "SGD" and legacy == 1  # average_aggregated_gradients on one case
    me, n = hvd.rank(), hvd.size()
    opt = hvd.DistributedOptimizer(make(), backward_passes_per_step=PASSES,
                                   average_aggregated_gradients=average, sparse_as_dense=True)
    x = tf.Variable([0.5, -1.0])
    y = tf.Variable([1.0, 2.0, 3.0])
    # The reference: the plain optimizer, given the combined gradient computed here.
    ref = make()
    ref_x, ref_y = tf.Variable(x.numpy()), tf.Variable(y.numpy())

    def loss(cx, cy):
        # tf.gather gives y an IndexedSlices gradient: sparse_as_dense makes it dense.
        return tf.reduce_sum(x * cx) + tf.reduce_sum(tf.gather(y, [0, 2]) * cy)

    def step(cx, cy):
        pairs = opt._compute_gradients(lambda: loss(cx, cy), var_list=[x, y])
        opt.apply_gradients(pairs, experimental_aggregate_gradients=False)
        return [g for g, _ in pairs]
    if in_function:
        step = tf.function(step)

    total = 2 * PASSES + 1
    local = np.zeros(5, np.float32)
    for t in range(total):
        cx, cy = coefficients(me, t)
        got = step(tf.constant(cx), tf.constant(cy))
        got = np.concatenate([np.asarray(tf.convert_to_tensor(g)) for g in got])
        local += dense(cx, cy)
        if (t + 1) % PASSES:
            # Between combinations: this rank's own running sums, nothing applied.
            np.testing.assert_array_equal(got, local)
        else:
            cycle = range(t + 1 - PASSES, t + 1)
            sums = [sum(dense(*coefficients(r, s)) for s in cycle) for r in range(n)]
            expected = (sum(s.astype(np.float64) for s in sums) / n).astype(np.float32)
            if average:
                expected = expected / np.float32(PASSES)
            np.testing.assert_array_equal(got, expected)
            # The reference has counted the same passes (Adam's bias correction reads it).
            ref.iterations.assign(t)
            ex, ey = split(expected)
            ref.apply_gradients([(tf.constant(ex), ref_x), (tf.constant(ey), ref_y)])
            local[:] = 0
        assert int(opt.iterations.numpy()) == t + 1  # every pass counts
        assert int(opt._agg_helper.counter.numpy()) == (t + 1) % PASSES
        if name == "SGD":
            np.testing.assert_array_equal(x.numpy(), ref_x.numpy())
            np.testing.assert_array_equal(y.numpy(), ref_y.numpy())
        else:
            np.testing.assert_allclose(x.numpy(), ref_x.numpy(), rtol=1e-6, atol=0)
            np.testing.assert_allclose(y.numpy(), ref_y.numpy(), rtol=1e-6, atol=0)
    # Variables moved (the test would be void otherwise) and agree on every rank.
    assert not np.array_equal(x.numpy(), [0.5, -1.0])
    both = hvd.allgather(tf.concat([x, y], 0)[None]).numpy()
    np.testing.assert_array_equal(both[0], both[-1])


@pytest.mark.parametrize("legacy", [0, 1], ids=["current", "legacy"])
def test_inf_gradient_does_not_leak_into_the_next_cycle(legacy):
    """Horovod's scenario: the first cycle's gradient is infinite; the sums are cleared by
    assignment, so the second cycle's combined gradient is exact and finite."""
    me, n = hvd.rank(), hvd.size()
    opt = hvd.DistributedOptimizer(FAMILIES["SGD"][legacy](), sparse_as_dense=True,
                                   backward_passes_per_step=PASSES)
    step_count = tf.Variable(0, trainable=False, dtype=tf.int32)
    x = tf.Variable(0.0)

    def loss():
        step_count.assign_add(1)
        return tf.cond(step_count > 1, lambda: x * float(me + 1), lambda: x * float("inf"))

    combined, after = [], []
    for t in range(2 * PASSES):
        pairs = opt._compute_gradients(loss=loss, var_list=[x])
        opt.apply_gradients(pairs)
        if (t + 1) % PASSES == 0:
            combined.append(float(pairs[0][0].numpy()))
            after.append(float(x.numpy()))
    assert combined[0] == float("inf")
    # The infinite update was applied.  (What the next one makes of it is the optimizer's
    # business: tf_keras's current SGD keeps a momentum slot, and 0 * inf is nan.)
    assert after[0] == float("-inf")
    # Second cycle: PASSES gradients of (rank + 1) each, averaged over the ranks.
    assert combined[1] == PASSES * sum(r + 1 for r in range(n)) / n
    assert int(opt._agg_helper.counter.numpy()) == 0
    assert int(opt.iterations.numpy()) == 2 * PASSES


def embedding_model(seed):
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(7, 2)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(size=(7, 2)).astype(np.float32)])
    return model


def embedding_batch(rank, t):
    rng = np.random.default_rng(1000 * rank + t)
    return (rng.integers(0, 7, size=(4, 3)).astype(np.int32),
            rng.normal(size=(4, 3, 2)).astype(np.float32))


@pytest.mark.parametrize("legacy", [0, 1], ids=["current", "legacy"])
def test_sparse_as_dense_with_aggregation_in_train_on_batch(legacy):
    """An embedding's IndexedSlices gradients summed dense over 2 passes of ``model.fit``'s
    step (train_on_batch), combined and applied on the 2nd; the 3rd is only summed."""
    me, n = hvd.rank(), hvd.size()
    make = FAMILIES["RMSprop"][legacy]
    opt = hvd.DistributedOptimizer(make(), sparse_as_dense=True, backward_passes_per_step=2)
    model = embedding_model(3)
    model.compile(optimizer=opt, loss="mse")
    initial = model.get_weights()[0]
    for t in range(3):
        model.train_on_batch(*embedding_batch(me, t))
    assert int(opt._agg_helper.counter.numpy()) == 3 % 2
    assert int(opt.iterations.numpy()) == 3
    # Reference: every rank's gradients of passes 0 and 1 at the initial weights (nothing
    # was applied in between), from a plain tape on a copy of the model, averaged.
    copy = embedding_model(3)
    mse = keras.losses.MeanSquaredError()
    total = np.zeros_like(initial, dtype=np.float64)
    for r in range(n):
        for t in range(2):
            bx, by = embedding_batch(r, t)
            with tf.GradientTape() as tape:
                value = mse(by, copy(bx))
            total += np.asarray(tf.convert_to_tensor(
                tape.gradient(value, copy.trainable_weights)[0]), np.float64)
    ref = make()
    ref_w = tf.Variable(initial)
    ref.apply_gradients([(tf.constant((total / n).astype(np.float32)), ref_w)])
    np.testing.assert_allclose(model.get_weights()[0], ref_w.numpy(), rtol=1e-5, atol=1e-7)
    assert not np.allclose(model.get_weights()[0], initial)
    # Without sparse_as_dense, IndexedSlices cannot be summed locally: Horovod's error.
    plain = hvd.DistributedOptimizer(make(), backward_passes_per_step=2)
    emb = embedding_model(4)
    with pytest.raises(ValueError) as err:
        plain._compute_gradients(lambda: tf.reduce_sum(emb(embedding_batch(me, 0)[0])),
                                 var_list=emb.trainable_weights)
    assert str(err.value) == hs.SPARSE_WITH_BACKWARD_PASSES


@pytest.mark.parametrize("how", ["minimize", "_compute_gradients"])
@pytest.mark.parametrize("scale", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("legacy", [0, 1], ids=["current", "legacy"])
def test_partial_distributed_optimizer_with_aggregation(legacy, scale, how):
    me, n = hvd.rank(), hvd.size()
    shared_layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    local_layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    inputs = keras.Input((1,))
    model = keras.Model(inputs, shared_layer(inputs) + local_layer(inputs))
    opt = hvd.PartialDistributedOptimizer(FAMILIES["SGD"][legacy](), local_layers=local_layer,
                                          backward_passes_per_step=2,
                                          scale_local_gradients=scale)
    features = tf.constant([[float(me + 1)]])
    for t in range(2):
        loss = lambda: tf.reduce_sum(model(features)) * float(t + 1)  # noqa: E731
        if how == "minimize":
            opt.minimize(loss, model.trainable_variables)
        else:
            with tf.GradientTape(persistent=True) as tape:
                value = loss()
            opt.apply_gradients(opt._compute_gradients(value, model.trainable_variables,
                                                       tape=tape))
        if t == 0:  # summed, not applied
            assert shared_layer.kernel.numpy()[0, 0] == 0.0
    # Each pass's gradient is (rank + 1) * (t + 1) for both kernels: 3 * (rank + 1) summed.
    shared = 3 * sum(r + 1 for r in range(n)) / n
    local = 3 * (me + 1) / (n if scale else 1)
    assert shared_layer.kernel.numpy()[0, 0] == np.float32(-shared)
    assert local_layer.kernel.numpy()[0, 0] == np.float32(-local)
    assert int(opt._agg_helper.counter.numpy()) == 0


def test_compute_gradients_answers_on_both_families_without_aggregation():
    """``_compute_gradients`` on a current optimizer and ``compute_gradients`` on a legacy
    one (the name the other family uses), flattening nested variable lists as Keras 2's
    legacy optimizers do; ``_agg_helper`` is None without aggregation, as in Horovod."""
    me, n = hvd.rank(), hvd.size()
    a, b, c = tf.Variable([1.0]), tf.Variable([2.0]), tf.Variable([3.0])
    mean = sum(r + 1 for r in range(n)) / n
    for make in FAMILIES["SGD"]:
        opt = hvd.DistributedOptimizer(make())
        assert opt._agg_helper is None
        loss = lambda: (a + 2 * b + 3 * c) * float(me + 1)  # noqa: E731
        pairs = opt._compute_gradients(loss, var_list=[[a, b], [c]])
        assert [v.ref() for _, v in pairs] == [a.ref(), b.ref(), c.ref()]
        np.testing.assert_array_equal([float(g.numpy()[0]) for g, _ in pairs],
                                      [mean, 2 * mean, 3 * mean])
        with tf.GradientTape() as tape:
            value = loss()
        pairs = opt.compute_gradients(value, [a, b, c], tape=tape)
        np.testing.assert_array_equal([float(g.numpy()[0]) for g, _ in pairs],
                                      [mean, 2 * mean, 3 * mean])
    current = hvd.DistributedOptimizer(FAMILIES["SGD"][0]())
    with pytest.raises(ValueError, match="grad_loss"):
        current._compute_gradients(lambda: a * 2.0, var_list=[a], grad_loss=tf.constant([1.0]))
