"""aiak_training.tensorflow, checked exactly on every rank, eagerly and inside tf.function.

Run under an MPI launcher by tests/test_tensorflow.py (AIAK_TEST_FRONTEND=tensorflow makes
conftest.py initialize this frontend); also runs as a single process.  References are
computed here with numpy from inputs every rank can rebuild (a pure function of rank and
seed), never through the library.  TensorFlow traces slowly, so each test builds one or
two tf.functions that run many checks at once.
"""
import os

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import aiak_training.tensorflow as hvd

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
          "float64": np.float64, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
          "int8": np.int8, "bool": np.bool_}
NUMERIC = [d for d in DTYPES if d != "bool"]
OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}


def data(rank, shape, dtype, seed=0):
    """Small integers, exact in every dtype: sums and products of up to 4 ranks stay exact
    (and in range for int8/uint8), and 1/size scalings are powers of two."""
    rng = np.random.default_rng(1000 * seed + rank)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(0 if dtype == "uint8" else -3, 4, shape).astype(DTYPES[dtype])


def everyone(shape, dtype, seed=0):
    return [data(r, shape, dtype, seed) for r in range(hvd.size())]


def reduce_ref(arrays, op, dtype):
    if dtype == "bool":
        stacked = np.stack(arrays)
        return stacked.any(0) if op in ("sum", "max") else stacked.all(0)
    wide = np.stack([a.astype(np.float64) for a in arrays])
    out = {"sum": wide.sum(0), "average": wide.sum(0) / len(arrays), "min": wide.min(0),
           "max": wide.max(0), "product": wide.prod(0)}[op]
    if np.issubdtype(DTYPES[dtype], np.integer):
        out = np.trunc(out)  # integer scaling truncates, as in Horovod
    return out.astype(DTYPES[dtype])


def check(actual, expected, what=""):
    actual_np = actual.numpy() if hasattr(actual, "numpy") else np.asarray(actual)
    expected = np.asarray(expected)
    assert actual_np.dtype == expected.dtype, (what, actual_np.dtype, expected.dtype)
    assert actual_np.shape == expected.shape, (what, actual_np.shape, expected.shape)
    assert np.array_equal(actual_np.astype(np.float64), expected.astype(np.float64)), \
        f"{what}\nactual={actual_np}\nexpected={expected}"


def tensor(array):
    return tf.constant(array)


# ---- basics ---------------------------------------------------------------------------------
def test_topology_and_flags():
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))
    size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))
    assert (hvd.rank(), hvd.size()) == (rank, size)
    assert hvd.is_initialized() and hvd.mpi_enabled() and hvd.mpi_built()
    assert not hvd.gloo_enabled()
    layout = [int(n) for n in os.environ.get("AIAK_TEST_LAYOUT", str(size)).split(",")]
    assert hvd.local_size() == layout[0 if rank < layout[0] else 1]
    assert hvd.is_homogeneous() == (len(set(layout)) == 1)
    assert hvd.cross_size() == len(layout)

    @tf.function
    def queries():
        return hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(), \
            hvd.process_set_included_op(0)
    for got in (queries(), (hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(),
                            hvd.local_size_op(), hvd.process_set_included_op(0))):
        assert [int(t) for t in got] == [hvd.rank(), hvd.size(), hvd.local_rank(),
                                         hvd.local_size(), 1]
        assert all(t.dtype == tf.int32 for t in got)
    assert int(hvd.process_set_included_op(12345)) == -3
    assert hvd.check_num_rank_power_of_2(4) and not hvd.check_num_rank_power_of_2(6)
    assert hvd.Average == 0 and hvd.Sum == 1 and hvd.Adasum == 2


# ---- allreduce ------------------------------------------------------------------------------
def _allreduce_cases():
    return [(d, op) for d in DTYPES for op in OPS if not (d == "bool" and op == "average")]


def test_allreduce_every_dtype_and_op():
    cases = _allreduce_cases()
    inputs = {case: everyone((3, 2), case[0], seed=i) for i, case in enumerate(cases)}
    me = hvd.rank()
    for case in cases:  # eager
        check(hvd.allreduce(tensor(inputs[case][me]), op=OPS[case[1]]),
              reduce_ref(inputs[case], case[1], case[0]), f"eager {case}")

    @tf.function
    def graph():
        return {case: hvd.allreduce(tensor(inputs[case][me]), op=OPS[case[1]])
                for case in cases}
    for case, out in graph().items():
        assert out.shape == (3, 2)
        check(out, reduce_ref(inputs[case], case[1], case[0]), f"graph {case}")
    with pytest.raises(ValueError, match="bool"):
        hvd.allreduce(tf.constant([True]), op=hvd.Average)


def test_allreduce_scaling_average_flag_and_variables():
    n, me = hvd.size(), hvd.rank()
    for dtype in ("float16", "bfloat16", "float32", "float64", "int32"):
        values = everyone((4,), dtype, seed=7)
        total = np.sum([v.astype(np.float64) for v in values], axis=0)
        expected = total * 0.5 * 4.0
        if dtype == "int32":
            expected = np.trunc(np.trunc(np.stack(values).astype(np.float64) * 0.5).sum(0) * 4)
        got = hvd.allreduce(tensor(values[me]), op=hvd.Sum, prescale_factor=0.5,
                            postscale_factor=4.0)
        check(got, expected.astype(DTYPES[dtype]), dtype)
    with pytest.warns(DeprecationWarning):
        check(hvd.allreduce(tf.constant([2.0]), average=False), np.float32([2.0 * n]))
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(tf.constant([1.0]), average=True, op=hvd.Sum)
    var = tf.Variable([1.0, float(me)])
    check(hvd.allreduce(var, op=hvd.Max), np.float32([1.0, n - 1]))
    check(hvd.allreduce(tf.constant(3.0), op=hvd.Sum), np.float32(3.0 * n))  # a scalar
    check(hvd.allreduce(tf.zeros([0, 3])), np.zeros((0, 3), np.float32))  # empty
    with pytest.raises(ValueError, match="int32"):  # Adasum combines float tensors only
        hvd.allreduce(tf.ones([2], tf.int32), op=hvd.Adasum)


def test_grouped_allreduce_mixed_dtypes_and_fp16_compression():
    n, me = hvd.size(), hvd.rank()
    a, b = everyone((5,), "float64", seed=3), everyone((2, 2), "int32", seed=4)
    for run in (lambda xs: hvd.grouped_allreduce(xs, op=hvd.Sum),
                tf.function(lambda xs: hvd.grouped_allreduce(xs, op=hvd.Sum))):
        got = run([tensor(a[me]), tensor(b[me])])
        assert isinstance(got, list) and len(got) == 2
        check(got[0], reduce_ref(a, "sum", "float64"))
        check(got[1], reduce_ref(b, "sum", "int32"))
    assert hvd.grouped_allreduce([]) == []
    c = everyone((6,), "float32", seed=5)
    got = hvd.allreduce(tensor(c[me]), compression=hvd.Compression.fp16)
    check(got, reduce_ref(c, "average", "float32"))  # small integers survive float16
    got = hvd.grouped_allreduce([tensor(c[me]), tf.constant([me])], op=hvd.Sum,
                                compression=hvd.Compression.fp16)
    check(got[0], reduce_ref(c, "sum", "float32"))
    check(got[1], np.int32([n * (n - 1) // 2]))


def test_many_independent_allreduces_in_one_function_run_in_program_order():
    """64 collectives with no data dependencies between them, in one graph: each rank must
    run them in one order or they deadlock (the driver runs this with one inter-op
    thread)."""
    n, me = hvd.size(), hvd.rank()
    shapes = [(i % 5 + 1, 3) for i in range(64)]
    values = [tf.Variable(data(me, s, "float32", seed=i)) for i, s in enumerate(shapes)]

    @tf.function
    def step():
        return [hvd.allreduce(v, op=hvd.Sum) for v in values]
    for _ in range(2):
        for i, out in enumerate(step()):
            check(out, reduce_ref([data(r, shapes[i], "float32", seed=i) for r in range(n)],
                                  "sum", "float32"), f"tensor {i}")


def test_large_results_reuse_memory_only_when_free():
    """Results of 1 MiB and more come from reused memory (runtime/arrays/array_pool.py): a result
    still held must never be handed out again."""
    import gc

    from aiak_training.runtime.arrays.array_pool import pool
    n = hvd.size()
    x = tf.fill([1 << 19], 1.0)  # 2 MiB
    graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
    kept = [hvd.allreduce(x, op=hvd.Sum), graph(x),
            hvd.allreduce(tf.cast(x, tf.bfloat16), op=hvd.Sum)]
    hits = pool.hits
    for i in range(4):
        out = hvd.allreduce(x * (i + 2), op=hvd.Sum) + graph(x * (i + 2))
        check(out[:3], np.full(3, 2.0 * n * (i + 2), np.float32))
        del out
        gc.collect()
    assert pool.hits > hits
    for k in kept:
        assert np.all(k.numpy().astype(np.float64) == n)


# ---- IndexedSlices --------------------------------------------------------------------------
def test_allreduce_indexed_slices():
    n, me = hvd.size(), hvd.rank()
    values = tf.constant(np.full((2, 3), me + 1.0, np.float32))
    slices = tf.IndexedSlices(values, tf.constant([me, 0]), dense_shape=tf.constant([n, 3]))
    expected_idx = np.int32([i for r in range(n) for i in (r, 0)])
    expected_val = np.repeat(np.arange(1, n + 1, dtype=np.float32), 2)[:, None] * \
        np.ones((1, 3), np.float32)
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        out = hvd.allreduce(slices, op=op)
        assert isinstance(out, tf.IndexedSlices)
        check(out.indices, expected_idx)
        check(out.values, (expected_val * scale).astype(np.float32))
        check(out.dense_shape, np.int32([n, 3]))
    mixed = hvd.grouped_allreduce([slices, tf.constant([1.0])], op=hvd.Sum)
    assert isinstance(mixed[0], tf.IndexedSlices)
    check(mixed[1], np.float32([n]))
    with pytest.raises(NotImplementedError, match="Only Sum and Average"):
        hvd.allreduce(slices, op=hvd.Max)
    with pytest.raises(NotImplementedError, match="Pre/postscale"):
        hvd.allreduce(slices, op=hvd.Sum, prescale_factor=2.0)


# ---- allgather / broadcast / alltoall / reducescatter ---------------------------------------
def test_allgather_and_broadcast_every_dtype():
    n, me = hvd.size(), hvd.rank()
    gathered = {d: [data(r, (r + 1, 2), d, seed=11) for r in range(n)] for d in DTYPES}
    shared = {d: everyone((3,), d, seed=12) for d in DTYPES}

    def run_all():
        out = {}
        for d in DTYPES:
            out["ag", d] = hvd.allgather(tensor(gathered[d][me]))
            for root in range(n):
                out["bc", d, root] = hvd.broadcast(tensor(shared[d][me]), root)
        out["grouped",] = hvd.grouped_allgather([tensor(gathered["int64"][me]),
                                                tensor(shared["float32"][me])])
        return out

    for mode, outs in (("eager", run_all()), ("graph", tf.function(run_all)())):
        for d in DTYPES:
            check(outs["ag", d], np.concatenate(gathered[d]), f"{mode} allgather {d}")
            for root in range(n):
                check(outs["bc", d, root], shared[d][root], f"{mode} broadcast {d}")
        check(outs["grouped",][0], np.concatenate(gathered["int64"]))
        check(outs["grouped",][1], np.concatenate(shared["float32"]))
    with pytest.raises(ValueError, match="rank >= 1"):
        hvd.allgather(tf.constant(1.0))
    with pytest.raises(ValueError, match="not a member"):
        hvd.broadcast(tf.ones([1]), n)


def test_broadcast_variables_inplace_and_in_function():
    n, me = hvd.size(), hvd.rank()
    root = n - 1
    variables = [tf.Variable(np.full((2, 2), me, np.float32)),
                 tf.Variable(np.full((3,), me, np.int64)),
                 tf.Variable(np.full((1,), me % 2 == 1))]
    assert hvd.broadcast_variables(variables, root_rank=root) is None
    check(variables[0], np.full((2, 2), root, np.float32))
    check(variables[1], np.full((3,), root, np.int64))
    check(variables[2], np.full((1,), root % 2 == 1))
    for v in variables:
        v.assign(tf.zeros_like(v) if v.dtype != tf.bool else tf.constant([me == 0]))
    values = hvd.broadcast_(variables, root_rank=0)
    check(values[1], np.zeros(3, np.int64))
    check(variables[2], np.array([True]))

    weights = tf.Variable(np.full((4,), me, np.float32))

    @tf.function
    def sync():
        hvd.broadcast_variables([weights], root_rank=root)
        return weights.read_value() + 1.0
    check(sync(), np.full((4,), root + 1.0, np.float32))


def test_alltoall_with_and_without_splits():
    n, me = hvd.size(), hvd.rank()
    even = tensor(np.arange(2 * n, dtype=np.int32) + 100 * me)
    # Rank r sends j + 1 rows to rank j, so it receives n * (me + 1) rows.
    rows = n * (n + 1) // 2
    uneven = tensor(np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 1000 * me)
    splits = [j + 1 for j in range(n)]

    def run_all():
        plain = hvd.alltoall(even)
        out, received = hvd.alltoall(uneven, splits=splits)
        out_t, received_t = hvd.alltoall(uneven, splits=tf.constant(splits))
        return plain, out, received, out_t, received_t

    expected_plain = np.concatenate([np.arange(2 * me, 2 * me + 2, dtype=np.int32) + 100 * src
                                     for src in range(n)])
    start = sum(j + 1 for j in range(me))
    block = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)[start:start + me + 1]
    expected = np.concatenate([block + 1000 * src for src in range(n)])
    for outs in (run_all(), tf.function(run_all)()):
        plain, out, received, out_t, received_t = outs
        check(plain, expected_plain)
        check(out, expected)
        check(out_t, expected)
        check(received, np.full(n, me + 1, np.int32))
        check(received_t, np.full(n, me + 1, np.int32))
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(uneven, splits=[1] * (n + 1))
    with pytest.raises(ValueError, match="exceeds"):
        hvd.alltoall(uneven, splits=[rows + 1] + [0] * (n - 1))


def test_reducescatter_uneven_rows():
    n, me = hvd.size(), hvd.rank()
    rows = 2 * n + 1
    base, extra = divmod(rows, n)
    counts = [base + (1 if r < extra else 0) for r in range(n)]
    start = sum(counts[:me])
    cases = [(d, op) for d in ("float32", "float64", "int32", "bfloat16") for op in
             ("sum", "average", "max")]
    inputs = {c: everyone((rows, 2), c[0], seed=20 + i) for i, c in enumerate(cases)}

    def run_all():
        out = {c: hvd.reducescatter(tensor(inputs[c][me]), op=OPS[c[1]]) for c in cases}
        out["default",] = hvd.reducescatter(tensor(inputs[cases[0]][me]))
        out["grouped",] = hvd.grouped_reducescatter(
            [tensor(inputs[cases[0]][me]), tensor(inputs[cases[3]][me])], op=hvd.Sum)
        return out

    graph = tf.function(run_all)
    assert graph.get_concrete_function().structured_outputs[cases[0]].shape == (counts[me], 2)
    for outs in (run_all(), graph()):
        for c in cases:
            check(outs[c], reduce_ref(inputs[c], c[1], c[0])[start:start + counts[me]], c)
        check(outs["default",], reduce_ref(inputs[cases[0]], "average", "float32")
              [start:start + counts[me]])
        check(outs["grouped",][0], reduce_ref(inputs[cases[0]], "sum", "float32")
              [start:start + counts[me]])
        check(outs["grouped",][1], reduce_ref(inputs[cases[3]], "sum", "float64")
              [start:start + counts[me]])
    with pytest.raises(ValueError, match="rank >= 1"):
        hvd.reducescatter(tf.constant(1.0))


# ---- gradients ------------------------------------------------------------------------------
def test_gradients_of_every_collective_eager_and_graph():
    n, me = hvd.size(), hvd.rank()
    weights_sum = float(sum(range(1, n + 1)))
    mean = weights_sum / n
    x = tf.Variable(np.ones(3, np.float32))
    y = tf.Variable(np.ones((me + 1, 2), np.float32))
    z = tf.Variable(np.ones(2, np.float32))
    rows = n * (n + 1) // 2
    s = tf.Variable(np.ones((rows, 2), np.float32))
    rs = tf.Variable(np.ones((2 * n, 3), np.float32))

    def grads():
        w = float(me + 1)
        with tf.GradientTape() as tape:
            g = hvd.allgather(y)
            gathered_rows = tf.cast(tf.range(tf.shape(g)[0]), tf.float32)[:, None]
            out, _ = hvd.alltoall(s, splits=[j + 1 for j in range(n)])
            received_rows = tf.cast(tf.range(tf.shape(out)[0]), tf.float32)[:, None]
            loss = (tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * w)
                    + tf.reduce_sum(hvd.allreduce(x, op=hvd.Average, prescale_factor=0.5,
                                                  postscale_factor=4.0) * w)
                    + tf.reduce_sum(g * gathered_rows * w)
                    + tf.reduce_sum(hvd.broadcast(z, 0) * w)
                    + tf.reduce_sum(out * (received_rows + 100.0 * me))
                    + tf.reduce_sum(hvd.reducescatter(rs, op=hvd.Sum, prescale_factor=0.5)
                                    * w))
        return tape.gradient(loss, [x, y, z, s, rs])

    start = sum(r + 1 for r in range(me))
    own_rows = np.arange(start, start + me + 1, dtype=np.float32)[:, None]
    # alltoall: the rows rank me sent to rank j come back with j's weights for them.
    sent = []
    for j in range(n):
        k = np.arange(me * (j + 1), (me + 1) * (j + 1), dtype=np.float32)
        sent.append(np.repeat((k + 100.0 * j)[:, None], 2, axis=1))
    expected = [np.full(3, weights_sum + mean * 2.0, np.float32),
                np.repeat(own_rows * mean, 2, axis=1).astype(np.float32),
                np.full(2, mean if me == 0 else 0.0, np.float32),
                np.concatenate(sent).astype(np.float32),
                np.concatenate([np.full((2, 3), (r + 1) * n * 0.5, np.float32)
                                for r in range(n)])]
    for mode, got in (("eager", grads()), ("graph", tf.function(grads)())):
        for i, (g, e) in enumerate(zip(got, expected)):
            check(g, e, f"{mode} gradient {i}")


def test_grouped_gradients():
    n, me = hvd.size(), hvd.rank()
    a = tf.Variable(np.ones((me + 1, 2), np.float32))
    b = tf.Variable(np.ones(n, np.float64))
    c = tf.Variable(np.ones((2 * n, 2), np.float32))

    def grads():
        with tf.GradientTape() as tape:
            ga, gb = hvd.grouped_allgather([a, b])
            ra, rb = hvd.grouped_allreduce([tf.reduce_sum(a, 0) * 2.0, b], op=hvd.Sum)
            (rc,) = hvd.grouped_reducescatter([c], op=hvd.Average)
            loss64 = tf.reduce_sum(gb) * 3.0 + tf.reduce_sum(rb) * (me + 1)
            loss = (tf.reduce_sum(ga) * (me + 1) + tf.reduce_sum(ra)
                    + tf.reduce_sum(rc) * (me + 1) + tf.cast(loss64, tf.float32))
        return tape.gradient(loss, [a, b, c])

    total = float(sum(range(1, n + 1)))
    expected = [np.full((me + 1, 2), total / n + 2.0 * n, np.float32),
                np.full(n, 3.0 + total, np.float64),
                np.concatenate([np.full((2, 2), r + 1.0, np.float32) for r in range(n)])]
    for got in (grads(), tf.function(grads)()):
        for g, e in zip(got, expected):
            check(g, e)


# ---- DistributedGradientTape ---------------------------------------------------------------
def _model_data(rank):
    rng = np.random.default_rng(rank)
    return (rng.integers(-2, 3, (4, 3)).astype(np.float32),
            rng.integers(0, 5, (4,)).astype(np.int32))


def _local_grads(rank, kernel, table):
    """This rank's own gradients of the test loss, in numpy: loss = sum((x @ kernel) *
    table[ids]) over the rows (an embedding lookup gives IndexedSlices)."""
    x, ids = _model_data(rank)
    emb = table[ids]
    g_kernel = x.T @ emb
    g_table = np.zeros_like(table)
    np.add.at(g_table, ids, x @ kernel)
    return g_kernel, g_table


def test_distributed_gradient_tape_averages_dense_and_sparse():
    n, me = hvd.size(), hvd.rank()
    kernel = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2) / 4)
    table = tf.Variable(np.arange(10, dtype=np.float32).reshape(5, 2) / 8)
    x, ids = _model_data(me)
    local = [_local_grads(r, kernel.numpy(), table.numpy()) for r in range(n)]
    mean_kernel = np.sum([g for g, _ in local], axis=0) / n
    mean_table = np.sum([t for _, t in local], axis=0) / n

    def step(sparse_as_dense, predivide):
        with tf.GradientTape() as tape:
            emb = tf.gather(table, ids)
            loss = tf.reduce_sum(tf.matmul(x, kernel) * emb)
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense,
                                           gradient_predivide_factor=predivide)
        return tape.gradient(loss, [kernel, table])

    graph = tf.function(step)
    for mode, run in (("eager", step), ("graph", graph)):
        for sparse_as_dense, predivide in ((False, 1.0), (True, 1.0), (True, 2.0)):
            g_kernel, g_table = run(sparse_as_dense, predivide)
            np.testing.assert_allclose(g_kernel.numpy(), mean_kernel, rtol=1e-6)
            assert isinstance(g_table, tf.IndexedSlices) != sparse_as_dense, mode
            np.testing.assert_allclose(tf.convert_to_tensor(g_table).numpy(), mean_table,
                                       rtol=1e-6, atol=1e-6)


def test_distributed_gradient_tape_options_and_local_sources():
    n, me = hvd.size(), hvd.rank()
    v = [tf.Variable(np.ones(2, np.float32)) for _ in range(4)]
    unused = tf.Variable(np.ones(2, np.float32))
    w = float(me + 1)
    with tf.GradientTape(persistent=True) as tape:
        loss = sum(tf.reduce_sum(x * w * (i + 1)) for i, x in enumerate(v))
    mean = float(sum(range(1, n + 1))) / n
    for options in ({}, {"groups": 2}, {"groups": [[v[3], v[0]]]}, {"op": hvd.Sum},
                    {"compression": hvd.Compression.fp16}):
        dist = hvd.DistributedGradientTape(tape, **options)
        assert isinstance(dist, tf.GradientTape) and type(dist).__name__ == "GradientTape"
        grads = dist.gradient(loss, v + [unused])
        factor = mean * n if options.get("op") == hvd.Sum else mean
        for i in range(4):
            check(grads[i], np.full(2, factor * (i + 1), np.float32), options)
        assert grads[4] is None
    dist = hvd.DistributedGradientTape(tape)
    dist.register_local_source(v[1])
    local, shared = dist.get_local_and_global_gradients(loss, v)
    assert [s is v[1] for s, _ in local] == [True] and len(shared) == 3
    check(local[0][1], np.full(2, w * 2 / n, np.float32))  # scaled, not reduced
    nested = hvd.DistributedGradientTape(tape).gradient(loss, {"a": v[0], "b": [v[2]]})
    check(nested["b"][0], np.full(2, mean * 3, np.float32))
    with tf.GradientTape() as recording:  # wrapped while still recording
        inner = hvd.DistributedGradientTape(recording)
        loss2 = tf.reduce_sum(v[0] * w)
    check(inner.gradient(loss2, [v[0]])[0], np.full(2, mean, np.float32))
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedGradientTape(tape, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="groups should be"):
        hvd.DistributedGradientTape(tape, groups=-1)
    with pytest.warns(DeprecationWarning):
        hvd.DistributedGradientTape(tape, num_groups=2)
    del tape


def test_training_loop_keeps_ranks_in_step():
    """A small model trained in a tf.function with DistributedGradientTape: every rank
    starts from rank 0's weights and, seeing different data, ends with identical ones."""
    import keras
    me = hvd.rank()
    keras.utils.set_random_seed(me)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.05)
    hvd.broadcast_variables(model.variables, root_rank=0)
    rng = np.random.default_rng(me)
    x = tf.constant(rng.normal(size=(16, 4)).astype(np.float32))
    y = tf.reduce_sum(x, axis=1, keepdims=True)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    first = float(train_step())
    for _ in range(20):
        last = float(train_step())
    assert last < first
    for v in model.variables:
        gathered = hvd.allgather(tf.reshape(v, [1, -1]))
        assert np.array_equal(gathered.numpy(), np.repeat(gathered.numpy()[:1], hvd.size(), 0))


# ---- SyncBatchNormalization ---------------------------------------------------------------
def test_sync_batch_normalization_uses_global_statistics():
    n, me = hvd.size(), hvd.rank()
    batches = [data(r, (r + 2, 3), "float32", seed=40) for r in range(n)]
    everything = np.concatenate(batches).astype(np.float64)
    mean, var = everything.mean(0), everything.var(0)
    layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    assert layer.name.startswith("sync_batch_normalization")
    out = layer(tensor(batches[me]), training=True)
    expected = (batches[me] - mean) / np.sqrt(var + 1e-3)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.5 + 0.5 * var, rtol=1e-5)
    graph_out = tf.function(lambda t: layer(t, training=True))(tensor(batches[me]))
    np.testing.assert_allclose(graph_out.numpy(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fused=True"):
        hvd.SyncBatchNormalization(fused=True)


# ---- objects and process sets ---------------------------------------------------------------
def test_objects():
    n, me = hvd.size(), hvd.rank()
    obj = {"rank": me, "payload": list(range(me + 3))}
    assert hvd.broadcast_object(obj, root_rank=n - 1) == {"rank": n - 1,
                                                          "payload": list(range(n + 2))}
    assert hvd.allgather_object(obj) == [{"rank": r, "payload": list(range(r + 3))}
                                         for r in range(n)]
    bcast = hvd.broadcast_object_fn(root_rank=0, name="fn")
    assert bcast(("x", me)) == ("x", 0) and bcast([me] * 3) == [0, 0, 0]
    assert hvd.allgather_object("y" * me * 50, name="var") == ["y" * r * 50 for r in range(n)]


def test_process_sets():
    n, me = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs two ranks")
    members = [r for r in range(n) if r % 2 == 0]
    evens = hvd.add_process_set(members)
    try:
        assert int(hvd.process_set_included_op(evens.process_set_id)) == int(me in members)
        if me in members:
            x = tf.constant([float(me)])
            check(hvd.allreduce(x, op=hvd.Sum, process_set=evens),
                  np.float32([sum(members)]))
            graph = tf.function(lambda t: (
                hvd.allreduce(t, process_set=evens),
                hvd.allgather(t, process_set=evens),
                hvd.broadcast(t, members[-1], process_set=evens)))
            avg, gathered, bcast = graph(x)
            check(avg, np.float32([sum(members) / len(members)]))
            check(gathered, np.float32(members))
            check(bcast, np.float32([members[-1]]))
            assert hvd.allgather_object(me, process_set=evens) == members
            hvd.barrier(process_set=evens)
        else:
            with pytest.raises(ValueError, match="not part"):
                hvd.allreduce(tf.zeros([1]), process_set=evens)
    finally:
        assert hvd.remove_process_set(evens)


# ---- bad input -----------------------------------------------------------------------------
def test_mismatches_raise_on_every_rank_eager_and_graph():
    n, me = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("a mismatch needs two ranks")
    with pytest.raises(tf.errors.FailedPreconditionError, match="mismatch_shape") as err:
        hvd.allreduce(tf.zeros([2 + me]), name="mismatch_shape")
    assert isinstance(err.value, hvd.HorovodInternalError)
    with pytest.raises(hvd.HorovodInternalError, match="data types.*mismatch_dtype"):
        hvd.allreduce(tf.zeros([2], tf.float32 if me == 0 else tf.float64),
                      name="mismatch_dtype")
    with pytest.raises(hvd.HorovodInternalError, match="root ranks"):
        hvd.broadcast(tf.zeros([2]), 0 if me == 0 else 1, name="mismatch_root")

    @tf.function
    def graph(t):
        with tf.name_scope("scope"):
            return hvd.allgather(t)
    with pytest.raises(tf.errors.FailedPreconditionError,  # Horovod's class in graphs too
                       match=r"Mismatched allgather tensor shapes on tensor "
                             r"scope/HorovodAllgather_t_0"):
        graph(tf.zeros([1, 2 + me]))
    check(hvd.allreduce(tf.ones([2]), op=hvd.Sum), np.full(2, n, np.float32))


def test_unsupported_inputs_and_jit_compile_are_refused_with_names():
    with pytest.raises(ValueError, match=r"tf\.string is not supported.*op my_strings"):
        hvd.allreduce(tf.constant(["a"]), name="my_strings")
    with pytest.raises(ValueError, match=r"tf\.complex128 is not supported.*eager tensor of "
                                         r"shape \(1,\)"):
        hvd.reducescatter(tf.constant([1j], tf.complex128))
    with pytest.raises(ValueError, match=r"tf\.complex64 is not supported.*tensor Const"):
        tf.function(lambda: hvd.allgather(tf.constant([1j], tf.complex64)))()
    with pytest.raises(ValueError, match=r"HorovodAllreduce_x_0 cannot run inside "
                                         r"tf\.function\(jit_compile=True\)"):
        tf.function(lambda x: hvd.allreduce(x), jit_compile=True)(tf.ones([2]))
    check(hvd.allreduce(tf.ones([2]), op=hvd.Sum), np.full(2, hvd.size(), np.float32))


def test_join_and_barrier():
    n, me = hvd.size(), hvd.rank()
    if me != n - 1:
        out = hvd.allreduce(tf.fill([4], 2.0), name="join_ar")
        check(out, np.full(4, 2.0 * (n - 1) / n, np.float32))
    last = hvd.join()
    assert last.dtype == tf.int32 and 0 <= int(last) < n
    hvd.barrier()
    tf.function(lambda: hvd.barrier() and None)()
