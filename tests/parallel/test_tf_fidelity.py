"""aiak_training.tensorflow where Horovod's TensorFlow users depend on its exact behaviour:
error classes in eager, tf.function and tf.compat.v1 graphs; broadcast_ on every variable
kind; the TF1 graph API (DistributedOptimizer over tf.compat.v1.train optimizers,
broadcast_global_variables, BroadcastGlobalVariablesHook).

Run at 2 and 4 ranks by tests/test_tf_fidelity.py (AIAK_TEST_FRONTEND=tensorflow).
References are computed here with numpy from inputs every rank can rebuild.
"""
import numpy as np
import pytest
import tensorflow as tf

import aiak_training.tensorflow as hvd


def v1_session(build):
    """Run ``build()`` in a fresh tf.compat.v1 graph with resource variables off (TF1's
    RefVariables), return (graph, session, whatever build returned)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.disable_resource_variables()
        try:
            built = build()
        finally:
            tf.compat.v1.enable_resource_variables()
    return graph, tf.compat.v1.Session(graph=graph), built


# ---- error classes ---------------------------------------------------------------------------
def test_mismatch_is_failed_precondition_in_every_mode():
    n, me = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("a mismatch needs two ranks")
    expected = r"Mismatched allreduce tensor shapes"
    with pytest.raises(tf.errors.FailedPreconditionError, match=expected) as eager:
        hvd.allreduce(tf.zeros([2 + me]), name="fid_eager")
    assert isinstance(eager.value, hvd.HorovodInternalError)

    @tf.function
    def graph(t):
        with tf.name_scope("fid_fn"):
            return hvd.allreduce(t) * 2.0
    with pytest.raises(tf.errors.FailedPreconditionError, match=expected + ".*fid_fn"):
        graph(tf.zeros([2 + me]))

    g, sess, out = v1_session(lambda: hvd.allgather(
        tf.compat.v1.placeholder(tf.float32, [None, None]), name="fid_v1") + 1.0)
    with sess, pytest.raises(tf.errors.FailedPreconditionError,
                             match=r"Mismatched allgather tensor shapes.*fid_v1"):
        sess.run(out, feed_dict={g.get_tensor_by_name("Placeholder:0"):
                                 np.zeros((1, 2 + me), np.float32)})
    # The job goes on: a matching collective after the failures is exact.
    assert np.array_equal(hvd.allreduce(tf.ones([3]), op=hvd.Sum).numpy(),
                          np.full(3, n, np.float32))


def test_argument_errors_are_invalid_argument_when_the_op_runs():
    n, me = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("needs two ranks")
    rows = tf.zeros([n + 1, 2])  # n + 1 rows do not divide among n ranks
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"dimension 0 \(3\)|not divisible"):
        hvd.alltoall(rows)
    with pytest.raises(ValueError, match="not divisible"):  # still a ValueError too
        hvd.alltoall(rows)
    fn = tf.function(lambda t: hvd.alltoall(t))
    traced = fn.get_concrete_function(tf.TensorSpec([n + 1, 2], tf.float32))  # builds fine
    with pytest.raises(tf.errors.InvalidArgumentError, match="not divisible"):
        traced(rows)

    others = hvd.add_process_set([r for r in range(n) if r != 0])
    try:
        if me == 0:
            with pytest.raises(tf.errors.InvalidArgumentError, match="not part of"):
                hvd.allreduce(tf.ones([2]), process_set=others)
            # Built without complaint, refused when run, in tf.function and in TF1 graphs.
            fn = tf.function(lambda t: hvd.allgather(t, process_set=others))
            with pytest.raises(tf.errors.InvalidArgumentError, match="not part of"):
                fn(tf.ones([1, 2]))
            g, sess, out = v1_session(lambda: hvd.reducescatter(tf.ones([4, 2]),
                                                                process_set=others))
            with sess, pytest.raises(tf.errors.InvalidArgumentError, match="not part of"):
                sess.run(out)
        else:
            got = hvd.allreduce(tf.ones([2]), op=hvd.Sum, process_set=others)
            assert np.array_equal(got.numpy(), np.full(2, n - 1, np.float32))
    finally:
        assert hvd.remove_process_set(others)


# ---- broadcast_ on every variable kind -------------------------------------------------------
def test_broadcast_inplace_every_variable_kind():
    n, me = hvd.size(), hvd.rank()
    root = n - 1
    mine = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * me
    theirs = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * root

    # Eager resource variable.
    var = tf.Variable(mine)
    values = hvd.broadcast_([var], root)
    assert np.array_equal(values[0].numpy(), theirs) and np.array_equal(var.numpy(), theirs)

    # Resource variable inside tf.function.
    var = tf.Variable(mine)
    got = tf.function(lambda: hvd.broadcast_([var], root)[0])()
    assert np.array_equal(got.numpy(), theirs) and np.array_equal(var.numpy(), theirs)

    # TF1 RefVariable in a graph: the returned tensor and the variable hold root's value.
    def build():
        ref = tf.compat.v1.Variable(mine, name="ref_var")
        assert not isinstance(ref, tf.__internal__.CompositeTensor) and \
            "RefVariable" in type(ref).__name__, type(ref)
        return ref, hvd.broadcast_([ref], root)[0]
    g, sess, (ref, result) = v1_session(build)
    with sess:
        sess.run(ref.initializer)
        assert np.array_equal(sess.run(result), theirs)
        assert np.array_equal(sess.run(ref), theirs)

    # Resource variable in a TF1 graph.
    graph = tf.Graph()
    with graph.as_default():
        res = tf.compat.v1.Variable(mine, use_resource=True)
        result = hvd.broadcast_([res], root)[0]
        with tf.compat.v1.Session() as sess:
            sess.run(res.initializer)
            assert np.array_equal(sess.run(result), theirs)
            assert np.array_equal(sess.run(res.read_value()), theirs)


# ---- TF1 graph API ---------------------------------------------------------------------------
def _linear_problem():
    """Per-rank data of a least-squares problem; returns (x, y) of every rank."""
    rng = [np.random.default_rng(50 + r) for r in range(hvd.size())]
    return [(g.normal(size=(8, 3)).astype(np.float32), g.normal(size=(8, 1)).astype(np.float32))
            for g in rng]


def _grad(w, x, y):
    """d/dw of mean((x @ w - y)^2)."""
    return 2.0 * x.T @ (x @ w - y) / x.shape[0]


def test_tf1_distributed_optimizer_and_global_variable_broadcast():
    me = hvd.rank()
    data = _linear_problem()
    w0 = np.random.default_rng(7 + me).normal(size=(3, 1)).astype(np.float32)  # differs per rank
    lr = 0.1

    def build():
        x = tf.constant(data[me][0])
        y = tf.constant(data[me][1])
        w = tf.compat.v1.get_variable("w", initializer=w0)
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr))
        assert isinstance(opt, tf.compat.v1.train.Optimizer)
        train = opt.minimize(loss, global_step=step)
        bcast = hvd.broadcast_global_variables(0)
        return w, step, train, bcast
    g, sess, (w, step, train, bcast) = v1_session(build)
    with sess:
        sess.run(tf.compat.v1.variables_initializer(g.get_collection("variables")))
        sess.run(bcast)
        start = np.random.default_rng(7).normal(size=(3, 1)).astype(np.float32)  # rank 0's
        assert np.allclose(sess.run(w), start)
        expected = start.astype(np.float64)
        for _ in range(3):
            sess.run(train)
            grads = [_grad(expected, x.astype(np.float64), y.astype(np.float64)) for x, y in data]
            expected = expected - lr * np.mean(grads, axis=0)
        assert np.allclose(sess.run(w), expected, atol=1e-5), (sess.run(w), expected)
        assert sess.run(step) == 3
    with pytest.raises(RuntimeError, match="does not support eager execution"):
        hvd.broadcast_global_variables(0)


def test_tf1_backward_passes_per_step_and_hook():
    n, me = hvd.size(), hvd.rank()
    data = _linear_problem()
    lr, passes = 0.05, 2
    start = np.full((3, 1), 0.5, np.float32)

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        # Rank-dependent start: BroadcastGlobalVariablesHook must bring root 1's (or 0's).
        w = tf.compat.v1.get_variable("w", initializer=start + me)
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr),
                                       backward_passes_per_step=passes,
                                       average_aggregated_gradients=True)
        pairs = opt.compute_gradients(loss)
        train = opt.apply_gradients(pairs, global_step=step)
        return x, y, w, step, train
    root = n - 1
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.disable_resource_variables()
        try:
            x, y, w, step, train = build()
        finally:
            tf.compat.v1.enable_resource_variables()
        hooks = [hvd.BroadcastGlobalVariablesHook(root)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            expected = (start + root).astype(np.float64)
            assert np.allclose(sess.run(w), expected)
            batches = [(xs[:4], ys[:4]) for xs, ys in data], [(xs[4:], ys[4:]) for xs, ys in data]
            for round_ in range(2):
                acc = np.zeros_like(expected)
                for k, batch in enumerate(batches):
                    sess.run(train, feed_dict={x: batch[me][0], y: batch[me][1]})
                    acc += np.mean([_grad(expected, bx.astype(np.float64), by.astype(np.float64))
                                    for bx, by in batch], axis=0)
                    if k == 0:  # the first pass only accumulates
                        assert np.allclose(sess.run(w), expected, atol=1e-5)
                expected = expected - lr * acc / passes
                assert np.allclose(sess.run(w), expected, atol=1e-5), (round_, expected)
            assert sess.run(step) == 2  # advanced only on the passes that applied


def test_tf1_optimizer_in_eager_tf2_and_refusals():
    n, me = hvd.size(), hvd.rank()
    w = tf.Variable([[1.0], [2.0]])
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5),
                                   op=hvd.Sum)
    pairs = opt.compute_gradients(lambda: tf.reduce_sum(w * float(me + 1)), var_list=[w])
    total = sum(r + 1 for r in range(n))
    assert np.allclose(pairs[0][0].numpy(), np.full((2, 1), total, np.float32))
    opt.apply_gradients(pairs)
    assert np.allclose(w.numpy(), np.array([[1.0], [2.0]]) - 0.5 * total)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                 backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                 op=hvd.Sum, gradient_predivide_factor=2.0)
