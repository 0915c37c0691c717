"""op=hvd.Adasum in aiak_training.tensorflow, eagerly and in tf.function, against the NumPy
reference in adasum_reference.py.  Run per rank by tests/test_adasum.py with
AIAK_TEST_FRONTEND=tensorflow (conftest.py then initializes this frontend)."""
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import aiak_training.tensorflow as hvd
from adasum_reference import adasum_tree

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
          "float64": np.float64}


def power_of_two() -> bool:
    n = hvd.size()
    return n & (n - 1) == 0


def rank_input(rank, shape, dtype, seed=0, scale=1.0):
    n = int(np.prod(shape))
    shared = np.random.default_rng(seed).standard_normal(n)
    own = np.random.default_rng(1000 * seed + rank + 1).standard_normal(n)
    return (scale * (shared + 0.8 * own)).reshape(shape).astype(DTYPES[dtype])


def everyone(shape, dtype, seed=0, scale=1.0):
    return [rank_input(r, shape, dtype, seed, scale) for r in range(hvd.size())]


def check(result, inputs, dtype):
    expected, bound = adasum_tree([np.asarray(a, np.float64) for a in inputs], dtype)
    got = np.asarray(result).astype(np.float64).ravel()
    assert result.dtype == tf.as_dtype(DTYPES[dtype]) and tuple(result.shape) == inputs[0].shape
    assert np.all(np.abs(got - expected) <= bound), np.max(np.abs(got - expected) - bound)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_allreduce_eager_and_in_tf_function(dtype):
    inputs = everyone((129,), dtype, seed=1)
    mine = tf.constant(inputs[hvd.rank()])
    if not power_of_two():
        with pytest.raises(NotImplementedError, match="non-power of 2 ranks"):
            hvd.allreduce(mine, op=hvd.Adasum)
        return
    check(hvd.allreduce(mine, op=hvd.Adasum), inputs, dtype)

    @tf.function
    def reduce(x):
        return hvd.allreduce(x, op=hvd.Adasum, name=f"adasum_{dtype}")
    check(reduce(mine), inputs, dtype)


def test_grouped_allreduce_uses_per_tensor_coefficients():
    groups = [everyone(s, "float32", seed=7 + i, scale=c)
              for i, (s, c) in enumerate([((6,), 1.0), ((40,), 1e-2), ((3, 3), 20.0)])]
    mine = [tf.constant(g[hvd.rank()]) for g in groups]
    if not power_of_two():
        with pytest.raises(NotImplementedError, match="non-power of 2 ranks"):
            hvd.grouped_allreduce(mine, op=hvd.Adasum)
        return
    for out, inputs in zip(hvd.grouped_allreduce(mine, op=hvd.Adasum), groups):
        check(out, inputs, "float32")


def test_distributed_gradient_tape_combines_gradients_with_adasum():
    # Gradients of sum(w * x_r) are x_r: the tape must return Adasum(x_0, ..., x_n-1).
    inputs = everyone((10,), "float64", seed=9)
    w = tf.Variable(tf.zeros(10, tf.float64))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * tf.constant(inputs[hvd.rank()]))
    tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
    if hvd.size() > 1 and not power_of_two():
        with pytest.raises(NotImplementedError, match="non-power of 2 ranks"):
            tape.gradient(loss, [w])
        return
    (grad,) = tape.gradient(loss, [w])
    check(grad, inputs, "float64")


def test_integer_tensors_are_refused():
    with pytest.raises(ValueError, match="int32"):
        hvd.allreduce(tf.constant([1, 2], tf.int32), op=hvd.Adasum)


@pytest.mark.parametrize("passes", [1, 2])
def test_legacy_distributed_optimizer_combines_updates(passes):
    """tf.compat.v1 MomentumOptimizer wrapped with op=Adasum: each rank applies its own
    gradients (momentum kept per rank), and every `passes` steps the variable becomes its
    start plus the Adasum of the ranks' changes.  Reference: every rank simulated in NumPy,
    with the loss 0.5 * sum(c_r (w - t_r)^2), whose gradient is c_r (w - t_r)."""
    n, me = hvd.size(), hvd.rank()
    rng = [np.random.default_rng(70 + r) for r in range(n)]
    targets = [g.standard_normal(6) for g in rng]
    weights = [0.5 + g.random(6) for g in rng]
    w0 = np.linspace(-1.0, 1.0, 6)
    # Binary fractions: TF1 optimizers hold their hyperparameters as float32 tensors.
    lr, momentum, steps = 0.125, 0.875, 4
    w = tf.Variable(w0)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(lr, momentum),
                                   op=hvd.Adasum, backward_passes_per_step=passes)
    if n > 1 and not power_of_two():
        with pytest.raises(NotImplementedError, match="non-power of 2 ranks"):
            for _ in range(passes):
                with tf.GradientTape() as tape:
                    loss = 0.5 * tf.reduce_sum(weights[me] * (w - targets[me]) ** 2)
                opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        return
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = 0.5 * tf.reduce_sum(weights[me] * (w - targets[me]) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

    local = [w0.copy() for _ in range(n)]
    accum = [np.zeros(6) for _ in range(n)]
    start = w0.copy()
    for step in range(steps):
        for r in range(n):
            accum[r] = accum[r] * momentum + weights[r] * (local[r] - targets[r])
            local[r] = local[r] - lr * accum[r]
        if step % passes == passes - 1:
            combined, _ = adasum_tree([x - start for x in local])
            start = start + combined
            local = [start.copy() for _ in range(n)]
    # float64 on both sides; they differ in operation order only (~1e-16 relative).
    np.testing.assert_allclose(w.numpy(), start, rtol=1e-12, atol=1e-14)
