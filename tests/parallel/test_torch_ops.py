"""Collectives of aiak_training.torch, checked exactly on every rank.

Run under an MPI launcher (see tests/test_multiprocess.py); also runs as a single process.
"""
import json
import os
import time

import pytest
import torch

import aiak_training.torch as hvd
from helpers import (FLOAT_TYPES, INT_TYPES, cast_like, expected_layout, rank_data,
                     my_reducescatter_block, reference_reduce, scale_like_horovod)

OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}
ALL_TYPES = INT_TYPES + FLOAT_TYPES


def everyone(shape, dtype, seed=0):
    return [rank_data(r, shape, dtype, seed) for r in range(hvd.size())]


def assert_same(actual, expected):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), f"\nactual={actual}\nexpected={expected}"


# ---- topology -------------------------------------------------------------------------------
def test_rank_and_size_match_launcher():
    if os.environ.get("HOROVOD_CONTROLLER") == "gloo":  # aiakrun --gloo: no MPI at all
        from mpi4py import MPI
        assert (hvd.rank(), hvd.size()) == (int(os.environ["HOROVOD_RANK"]),
                                            int(os.environ["HOROVOD_SIZE"]))
        assert hvd.gloo_enabled() and not hvd.mpi_enabled() and not MPI.Is_initialized()
        assert not hvd.mpi_threads_supported()
        return
    # The launcher's word: MPICH's hydra or Open MPI; Ray actors joined to an MPI world
    # (PMI_PORT mode, no PMI_RANK) have it from the executor as Horovod's variables.
    env = os.environ
    rank = int(env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK", env.get("HOROVOD_RANK", 0))))
    size = int(env.get("PMI_SIZE", env.get("OMPI_COMM_WORLD_SIZE", env.get("HOROVOD_SIZE", 1))))
    assert (hvd.rank(), hvd.size()) == (rank, size)
    assert hvd.is_initialized()
    assert hvd.mpi_enabled() and hvd.mpi_built() and not hvd.gloo_enabled()
    threads_disabled = os.environ.get("HOROVOD_MPI_THREADS_DISABLE") == "1"
    assert hvd.mpi_threads_supported() == (not threads_disabled)


def test_local_and_cross_topology():
    layout = expected_layout() or [hvd.size()]
    node, first = 0, 0
    while hvd.rank() >= first + layout[node]:
        first += layout[node]
        node += 1
    assert hvd.local_size() == layout[node]
    assert hvd.local_rank() == hvd.rank() - first
    assert hvd.cross_rank() == sum(1 for n in range(node) if layout[n] > hvd.local_rank())
    assert hvd.cross_size() == sum(1 for n in layout if n > hvd.local_rank())
    assert hvd.is_homogeneous() == (len(set(layout)) == 1)


# ---- allreduce ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_TYPES + [torch.bool])
@pytest.mark.parametrize("op", list(OPS))
def test_allreduce_every_dtype_and_op(dtype, op):
    if dtype == torch.bool and op == "average":
        with pytest.raises(ValueError, match="bool"):
            hvd.allreduce(torch.zeros(3, dtype=torch.bool), op=OPS[op])
        return
    shape = (3, 5)
    tensors = everyone(shape, dtype, seed=1)
    mine = tensors[hvd.rank()]
    before = mine.clone()
    out = hvd.allreduce(mine, op=OPS[op], name=f"ar.{dtype}.{op}")
    assert_same(out, reference_reduce(tensors, op))
    assert torch.equal(mine, before), "out-of-place allreduce modified its input"


@pytest.mark.parametrize("dtype", ALL_TYPES)
def test_allreduce_prescale_postscale(dtype):
    tensors = everyone((17,), dtype, seed=2)
    for pre, post in [(0.5, 1.0), (1.0, 0.25), (1.5, 2.0), (2.0, 0.5)]:
        out = hvd.allreduce(tensors[hvd.rank()], op=hvd.Sum, prescale_factor=pre,
                            postscale_factor=post)
        # Each rank scales, truncating integers, then the sum is scaled again.
        scaled = [cast_like(t.to(torch.float64) * pre, dtype) for t in tensors]
        summed = reference_reduce(scaled, "sum").to(torch.float64)
        assert_same(out, cast_like(summed * post, dtype))


def test_allreduce_average_with_postscale_integer():
    tensors = everyone((9,), torch.int32, seed=3)
    out = hvd.allreduce(tensors[hvd.rank()], op=hvd.Average, postscale_factor=3.0)
    total = torch.stack([t.to(torch.float64) for t in tensors]).sum(0)
    assert_same(out, cast_like(total * (3.0 / hvd.size()), torch.int32))


def test_allreduce_deprecated_average_argument():
    t = torch.ones(4) * (hvd.rank() + 1)
    total = sum(range(1, hvd.size() + 1))
    with pytest.warns(DeprecationWarning):
        assert torch.equal(hvd.allreduce(t, average=False), torch.full((4,), float(total)))
    with pytest.warns(DeprecationWarning):
        assert torch.equal(hvd.allreduce(t, average=True),
                           torch.full((4,), total / hvd.size()))
    with pytest.raises(ValueError):
        hvd.allreduce(t, average=True, op=hvd.Sum)


def test_allreduce_inplace_and_async_variants():
    tensors = everyone((6, 2), torch.float32, seed=4)
    expected = reference_reduce(tensors, "sum")
    t = tensors[hvd.rank()].clone()
    assert hvd.allreduce_(t, op=hvd.Sum) is t
    assert_same(t, expected)
    t = tensors[hvd.rank()].clone()
    h = hvd.allreduce_async_(t, op=hvd.Sum)
    assert hvd.synchronize(h) is t
    assert_same(t, expected)
    h = hvd.allreduce_async(tensors[hvd.rank()], op=hvd.Sum)
    while not hvd.poll(h):
        time.sleep(0.001)
    assert_same(hvd.synchronize(h), expected)
    # A consumed or unknown handle is an error, the same one poll() raises.
    for consumed_or_unknown in (h, 123456789):
        with pytest.raises(ValueError, match=f"Handle {consumed_or_unknown} was not created "
                                             "or has been cleared"):
            hvd.synchronize(consumed_or_unknown)
        with pytest.raises(ValueError, match="was not created or has been cleared"):
            hvd.poll(consumed_or_unknown)


def test_allreduce_inplace_noncontiguous():
    base = everyone((4, 6), torch.float64, seed=5)
    expected = reference_reduce([b.t() for b in base], "sum")
    t = base[hvd.rank()].clone().t()
    assert not t.is_contiguous()
    hvd.allreduce_(t, op=hvd.Sum)
    assert torch.equal(t, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_large_out_of_place_results_reuse_pooled_memory(dtype):
    """Results of >= 1 MiB come from the output pool: freed memory holding old values is
    handed out again, and every result must still be exact and independent."""
    from aiak_training.torch.output_pool import pool
    shape = (300, 1100)  # > 1 MiB for every dtype here
    for round_ in range(3):
        tensors = everyone(shape, dtype, seed=40 + round_)
        expected = reference_reduce(tensors, "sum")
        outs = hvd.grouped_allreduce([tensors[hvd.rank()], tensors[hvd.rank()] * 2],
                                     op=hvd.Sum, name=f"pooled.{dtype}.{round_}")
        assert_same(outs[0], expected)
        assert_same(outs[1], reference_reduce([t * 2 for t in tensors], "sum"))
        assert outs[0].data_ptr() != outs[1].data_ptr()
        del outs  # back to the pool, still holding this round's values
    assert pool.hits > 0


def test_allreduce_empty_and_scalar():
    out = hvd.allreduce(torch.zeros(0, 3), op=hvd.Sum, name="empty")
    assert out.shape == (0, 3)
    out = hvd.allreduce(torch.tensor(float(hvd.rank())), op=hvd.Sum, name="scalar")
    assert out.shape == () and out.item() == sum(range(hvd.size()))


def test_grouped_allreduce_mixed_dtypes():
    dtypes = [torch.float32, torch.int64, torch.float16, torch.float32, torch.bfloat16]
    groups = [everyone((i + 2, 3), dt, seed=10 + i) for i, dt in enumerate(dtypes)]
    outs = hvd.grouped_allreduce([g[hvd.rank()] for g in groups], op=hvd.Sum)
    assert isinstance(outs, list) and len(outs) == len(dtypes)  # as Horovod: a list here,
    # and tuples from grouped_allreduce_ and from synchronize of a grouped handle
    for out, g in zip(outs, groups):
        assert_same(out, reference_reduce(g, "sum"))
    ins = [g[hvd.rank()].clone() for g in groups]
    res = hvd.grouped_allreduce_(ins, op=hvd.Max)
    assert isinstance(res, tuple) and len(res) == len(dtypes)
    for out, t, g in zip(res, ins, groups):
        assert out is t
        assert_same(t, reference_reduce(g, "max"))
    h = hvd.grouped_allreduce_async([g[hvd.rank()] for g in groups], op=hvd.Min, name="gmin")
    res = hvd.synchronize(h)
    assert isinstance(res, tuple)
    for out, g in zip(res, groups):
        assert_same(out, reference_reduce(g, "min"))


def test_many_small_async_tensors_fuse_correctly():
    n = 150
    data = [everyone((64 + i,), torch.float32, seed=100 + i) for i in range(n)]
    handles = [hvd.allreduce_async(d[hvd.rank()], op=hvd.Average, name=f"small.{i}")
               for i, d in enumerate(data)]
    for h, d in zip(handles, data):
        assert_same(hvd.synchronize(h), reference_reduce(d, "average"))


def test_repeated_steps_use_cache_and_stay_exact():
    # Same names and shapes every step: steady state goes through the response cache.
    for step in range(5):
        data = [everyone((8, 8), torch.float32, seed=200 + 7 * step + i) for i in range(6)]
        hs = [hvd.allreduce_async(d[hvd.rank()], op=hvd.Sum, name=f"step.{i}")
              for i, d in enumerate(data)]
        for h, d in zip(hs, data):
            assert_same(hvd.synchronize(h), reference_reduce(d, "sum"))
    # The shape of a cached name changes: it must be renegotiated, not mis-reduced.
    data = everyone((3,), torch.float32, seed=300)
    assert_same(hvd.allreduce(data[hvd.rank()], op=hvd.Sum, name="step.0"),
                reference_reduce(data, "sum"))


def test_out_of_order_submission():
    names = [f"ooo.{i}" for i in range(12)]
    data = {n: everyone((5,), torch.int64, seed=400 + i) for i, n in enumerate(names)}
    order = names if hvd.rank() % 2 == 0 else list(reversed(names))
    if hvd.rank() % 3 == 1:
        order = order[5:] + order[:5]
    handles = {n: hvd.allreduce_async(data[n][hvd.rank()], op=hvd.Sum, name=n) for n in order}
    for n in reversed(order):
        assert_same(hvd.synchronize(handles[n]), reference_reduce(data[n], "sum"))


def test_duplicate_inflight_name_raises_value_error():
    if hvd.size() == 1:
        pytest.skip("on one rank the first op may complete before the second call")
    t = torch.ones(3)
    if hvd.rank() == 0:
        h = hvd.allreduce_async(t, name="dup")
        with pytest.raises(ValueError, match="same name"):
            hvd.allreduce_async(t, name="dup")
    else:
        time.sleep(0.3)  # keep rank 0's first "dup" in flight
        h = hvd.allreduce_async(t, name="dup")
    assert torch.equal(hvd.synchronize(h), torch.ones(3))


def test_unsupported_inputs_raise_value_error():
    with pytest.raises(ValueError, match="not supported"):
        hvd.allreduce(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="int32"):  # Adasum combines float tensors only
        hvd.allreduce(torch.zeros(2, dtype=torch.int32), op=hvd.Adasum)


# ---- mismatches surface on every rank ----------------------------------------------------
def test_shape_mismatch_raises_on_every_rank():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    t = torch.zeros(2 + hvd.rank())
    with pytest.raises(hvd.HorovodInternalError, match="mismatch_shape"):
        hvd.allreduce(t, name="mismatch_shape")


def test_dtype_mismatch_raises_on_every_rank():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    t = torch.zeros(4, dtype=torch.float32 if hvd.rank() == 0 else torch.float64)
    with pytest.raises(hvd.HorovodInternalError, match="mismatch_dtype"):
        hvd.allreduce(t, name="mismatch_dtype")


def test_op_mismatch_raises_on_every_rank():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    with pytest.raises(hvd.HorovodInternalError, match="mismatch_op"):
        hvd.allreduce(torch.zeros(4), op=op, name="mismatch_op")


def test_root_mismatch_raises_on_every_rank():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    root = 0 if hvd.rank() == 0 else 1
    with pytest.raises(hvd.HorovodInternalError, match="mismatch_root"):
        hvd.broadcast(torch.zeros(4), root, name="mismatch_root")


def test_engine_keeps_working_after_errors():
    t = torch.ones(5)
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum, name="after_errors"),
                       torch.full((5,), float(hvd.size())))


# ---- allgather ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_TYPES + [torch.bool])
def test_allgather_variable_first_dimension(dtype):
    tensors = [rank_data(r, (r % 3, 4, 2), dtype, seed=20) for r in range(hvd.size())]
    out = hvd.allgather(tensors[hvd.rank()], name=f"ag.{dtype}")
    assert_same(out, torch.cat(tensors, 0))


def test_grouped_allgather():
    groups = [[rank_data(r, (r + 1, 3), dt, seed=30 + i) for r in range(hvd.size())]
              for i, dt in enumerate([torch.float32, torch.int8, torch.float64])]
    outs = hvd.grouped_allgather([g[hvd.rank()] for g in groups])
    assert isinstance(outs, tuple) and len(outs) == 3
    for out, g in zip(outs, groups):
        assert_same(out, torch.cat(g, 0))
    outs = hvd.synchronize(hvd.grouped_allgather_async([g[hvd.rank()] for g in groups]))
    assert isinstance(outs, tuple)
    for out, g in zip(outs, groups):
        assert_same(out, torch.cat(g, 0))
    with pytest.raises(ValueError, match="at least one tensor"):
        hvd.grouped_allgather([])


def test_allgather_mismatched_trailing_dims_raises():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    t = torch.zeros(2, 3 + hvd.rank())
    with pytest.raises(hvd.HorovodInternalError, match="ag_mismatch"):
        hvd.allgather(t, name="ag_mismatch")


# ---- broadcast ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_TYPES + [torch.bool])
def test_broadcast_from_every_root(dtype):
    tensors = everyone((4, 3), dtype, seed=40)
    for root in range(hvd.size()):
        mine = tensors[hvd.rank()].clone()
        out = hvd.broadcast(mine, root, name=f"bc.{dtype}.{root}")
        assert_same(out, tensors[root])
        assert torch.equal(mine, tensors[hvd.rank()])
        hvd.broadcast_(mine, root)
        assert_same(mine, tensors[root])


def test_broadcast_invalid_root():
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.zeros(1), hvd.size())


# ---- alltoall -------------------------------------------------------------------------------
def test_alltoall_equal_splits():
    n = hvd.size()
    tensors = [torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) + 1000 * r
               for r in range(n)]
    out = hvd.alltoall(tensors[hvd.rank()])
    me = hvd.rank()
    expected = torch.cat([tensors[src][2 * me:2 * me + 2] for src in range(n)])
    assert_same(out, expected)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_alltoall_with_splits(as_tensor):
    n, me = hvd.size(), hvd.rank()
    splits_of = [[(src + dst) % 3 for dst in range(n)] for src in range(n)]
    tensors = [rank_data(src, (sum(splits_of[src]) + 1, 2), torch.int32, seed=50)
               for src in range(n)]  # one extra row that is not sent
    splits = splits_of[me]
    if as_tensor:
        splits = torch.tensor(splits, dtype=torch.int32)
    out, received = hvd.alltoall(tensors[me], splits=splits)
    pieces = []
    for src in range(n):
        start = sum(splits_of[src][:me])
        pieces.append(tensors[src][start:start + splits_of[src][me]])
    assert_same(out, torch.cat(pieces))
    assert_same(received, torch.tensor([splits_of[src][me] for src in range(n)],
                                       dtype=torch.int32))


def test_alltoall_bad_splits_raise_value_error():
    n = hvd.size()
    with pytest.raises(ValueError, match="int32"):
        hvd.alltoall(torch.zeros(n, 2), splits=torch.ones(n, dtype=torch.int64))
    with pytest.raises(ValueError, match="exceeds"):
        hvd.alltoall(torch.zeros(n, 2), splits=[2] * n)
    if n > 1:
        with pytest.raises(ValueError, match="divisible"):
            hvd.alltoall(torch.zeros(n + 1, 2))


# ---- reducescatter --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_TYPES)
@pytest.mark.parametrize("op", ["sum", "average", "min", "max"])
def test_reducescatter_uneven(dtype, op):
    n, me = hvd.size(), hvd.rank()
    rows = 2 * n + 1
    tensors = everyone((rows, 3), dtype, seed=60)
    out = hvd.reducescatter(tensors[me], op=OPS[op], name=f"rs.{dtype}.{op}")
    full = reference_reduce(tensors, op)
    assert_same(out, my_reducescatter_block(full, me, n))


def test_reducescatter_default_op_is_average_and_scaling():
    n, me = hvd.size(), hvd.rank()
    tensors = everyone((2 * n, 2), torch.float32, seed=61)
    out = hvd.reducescatter(tensors[me])
    full = reference_reduce(tensors, "average")
    assert_same(out, full[2 * me:2 * me + 2])
    out = hvd.reducescatter(tensors[me], op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    assert_same(out, reference_reduce(tensors, "sum")[2 * me:2 * me + 2] * 2.0)


def test_grouped_reducescatter():
    n, me = hvd.size(), hvd.rank()
    groups = [everyone((n * (i + 1), 2), torch.float64, seed=70 + i) for i in range(3)]
    outs = hvd.grouped_reducescatter([g[me] for g in groups], op=hvd.Sum)
    assert isinstance(outs, list)
    assert isinstance(hvd.synchronize(hvd.grouped_reducescatter_async([groups[0][me]])), tuple)
    for i, (out, g) in enumerate(zip(outs, groups)):
        k = i + 1
        assert_same(out, reference_reduce(g, "sum")[k * me:k * (me + 1)])


def test_reducescatter_scalar_raises():
    with pytest.raises(ValueError):
        hvd.reducescatter(torch.tensor(1.0))


# ---- autograd -------------------------------------------------------------------------------
def test_allreduce_allgather_broadcast_gradients():
    n, me = hvd.size(), hvd.rank()
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * (me + 1)).sum().backward()
    # d/dx_me of sum_k (k+1) * sum_r x_r  = sum_k (k+1)
    assert torch.equal(x.grad, torch.full((3,), float(sum(range(1, n + 1)))))

    # Horovod averages the gradients of allgather and broadcast over the ranks (Average
    # multiplies the float32 sum by float32(1/n) in float32).
    mean = float(scale_like_horovod(torch.tensor(float(sum(range(1, n + 1)))), 1.0 / n))
    y = torch.ones(me + 1, 2, requires_grad=True)
    g = hvd.allgather(y)
    (g * (me + 1)).sum().backward()
    assert torch.equal(y.grad, torch.full((me + 1, 2), mean))

    z = torch.ones(2, requires_grad=True)
    (hvd.broadcast(z, 0) * (me + 1)).sum().backward()
    assert torch.equal(z.grad, torch.full((2,), mean if me == 0 else 0.0))


def test_grouped_allgather_gradients():
    n, me = hvd.size(), hvd.rank()
    a = torch.ones(me + 1, 2, requires_grad=True)
    b = torch.ones(2 * me + 1, requires_grad=True)
    ga, gb = hvd.grouped_allgather([a, b])
    assert ga.shape == (n * (n + 1) // 2, 2) and gb.shape == (n * n,)
    # A weight that depends on the row, so each rank's slice of the gradient is distinct.
    wa = torch.arange(ga.shape[0], dtype=torch.float32).unsqueeze(1)
    ((ga * wa).sum() * (me + 1) + (gb * 3.0).sum() * (me + 1)).backward()
    start = sum(r + 1 for r in range(me))
    rows = torch.arange(start, start + me + 1, dtype=torch.float32).unsqueeze(1)
    expected_a = scale_like_horovod(rows * sum(range(1, n + 1)), 1.0 / n).expand(me + 1, 2)
    assert torch.equal(a.grad, expected_a)
    assert torch.equal(b.grad, scale_like_horovod(
        torch.full((2 * me + 1,), 3.0 * sum(range(1, n + 1))), 1.0 / n))


@pytest.mark.parametrize("op,pre,post", [("sum", 1.0, 1.0), ("average", 1.0, 1.0),
                                         ("sum", 0.5, 4.0)])
def test_reducescatter_gradients(op, pre, post):
    """Horovod's convention: the output gradient is gathered, times the set size for Sum,
    unchanged for Average, then times the scale factors."""
    n, me = hvd.size(), hvd.rank()
    x = torch.ones(2 * n, 3, requires_grad=True)
    out = hvd.reducescatter(x, op=OPS[op], prescale_factor=pre, postscale_factor=post)
    (out * (me + 1)).sum().backward()
    factor = (n if op == "sum" else 1) * pre * post
    expected = torch.cat([torch.full((2, 3), (r + 1) * factor) for r in range(n)])
    assert torch.equal(x.grad, expected)

    y = [torch.ones(n, requires_grad=True), torch.ones(3 * n, 2, requires_grad=True)]
    outs = hvd.grouped_reducescatter(y, op=OPS[op], prescale_factor=pre, postscale_factor=post)
    (outs[0].sum() * (me + 1) + outs[1].sum() * 2 * (me + 1)).backward()
    assert torch.equal(y[0].grad, torch.cat([torch.full((1,), (r + 1) * factor)
                                             for r in range(n)]))
    assert torch.equal(y[1].grad, torch.cat([torch.full((3, 2), 2 * (r + 1) * factor)
                                             for r in range(n)]))


def test_alltoall_gradients_and_async_result():
    n, me = hvd.size(), hvd.rank()
    # Without splits, synchronize still gives (output, received splits), as in Horovod.
    out, received = hvd.synchronize(hvd.alltoall_async(torch.arange(2 * n) + 10 * me))
    assert torch.equal(out, torch.cat([torch.arange(2 * me, 2 * me + 2) + 10 * src
                                       for src in range(n)]))
    assert received.dtype == torch.int32 and received.tolist() == [2] * n
    x = torch.ones(2 * n, 3, requires_grad=True)
    (hvd.alltoall(x) * (me + 1)).sum().backward()
    # Rows sent to rank d come back with rank d's weight.
    assert torch.equal(x.grad, torch.cat([torch.full((2, 3), float(d + 1)) for d in range(n)]))


# ---- control ops ----------------------------------------------------------------------------
def test_barrier_synchronizes():
    if hvd.rank() == 0:
        time.sleep(0.3)
    start = time.monotonic()
    hvd.barrier()
    waited = time.monotonic() - start
    marks = hvd.allgather_object(waited)
    if hvd.size() > 1:
        assert max(marks[1:]) >= 0.2  # the others waited for rank 0


def test_join_zero_contribution():
    n, me = hvd.size(), hvd.rank()
    if me == n - 1:
        last = hvd.join()
    else:
        out = hvd.allreduce(torch.full((4,), 2.0), name="join_ar")
        # The joined rank contributes zeros and Average still divides by the full size.
        assert torch.equal(out, torch.full((4,), 2.0 * (n - 1) / n))
        last = hvd.join()
    lasts = hvd.allgather_object(last)
    assert len(set(lasts)) == 1 and 0 <= lasts[0] < n


def test_process_sets_dynamic():
    n, me = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs two ranks")
    evens = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    try:
        assert evens.process_set_id is not None and evens.process_set_id > 0
        members = [r for r in range(n) if r % 2 == 0]
        assert evens.size() == len(members)
        assert evens.included() == (me in members)
        if me in members:
            assert evens.rank() == members.index(me)
            out = hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum, process_set=evens)
            assert out.item() == float(sum(members))
            root = members[-1]
            assert hvd.broadcast(torch.tensor([me]), root, process_set=evens).item() == root
            g = hvd.allgather(torch.tensor([me]), process_set=evens)
            assert g.tolist() == members
            hvd.barrier(process_set=evens)
        else:
            with pytest.raises(ValueError, match="not part"):
                hvd.allreduce(torch.zeros(1), process_set=evens)
            with pytest.raises(ValueError, match="not part of provided process set"):
                evens.rank()
        with pytest.raises(ValueError, match="already"):
            hvd.add_process_set(members)
    finally:
        assert hvd.remove_process_set(evens)
    # Removed: no id any more, so size() and rank() say None; included() still knows the ranks.
    assert evens.size() is None and evens.rank() is None
    assert evens.included() == (me in members)
    assert not hvd.remove_process_set(hvd.global_process_set)
    assert hvd.global_process_set.size() == n and hvd.global_process_set.rank() == me


# ---- object helpers ---------------------------------------------------------------------------
def test_broadcast_object_and_allgather_object():
    obj = {"rank": hvd.rank(), "payload": list(range(hvd.rank() + 3))}
    got = hvd.broadcast_object(obj, root_rank=hvd.size() - 1)
    assert got == {"rank": hvd.size() - 1, "payload": list(range(hvd.size() + 2))}
    allg = hvd.allgather_object(obj)
    assert allg == [{"rank": r, "payload": list(range(r + 3))} for r in range(hvd.size())]


def test_broadcast_parameters_and_optimizer_state():
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)
    assert opt.param_groups[0]["lr"] == 0.01
    assert len(opt.state_dict()["state"]) == 4
    with pytest.raises(ValueError):
        hvd.broadcast_parameters(model.named_parameters(), root_rank=0)


# ---- timeline -------------------------------------------------------------------------------
def test_timeline(tmp_path_factory):
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("tl") / "timeline.json"), 0)
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(10), name="test_allreduce")
    time.sleep(0.01)
    hvd.stop_timeline()
    if hvd.rank() == 0:
        text = open(path).read()
        json.loads(text)
        for marker in ("allreduce.test_allreduce", "start_time_since_epoch_in_micros",
                       "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"):
            assert marker in text, marker


def test_broadcast_object_process_set():
    n, me = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs two ranks")
    members = [r for r in range(n) if r % 2 == 1]
    odds = hvd.add_process_set(members)
    try:
        if me in members:
            root = members[-1]
            obj = (me, [me] * me, {"scale": lambda v: v * (me + 1)})
            got = hvd.broadcast_object(obj, root_rank=root, name="odd_obj", process_set=odds)
            if me == root:
                assert got is obj
            assert type(got) is tuple and got[:2] == (root, [root] * root)
            assert got[2]["scale"](2) == 2 * (root + 1)
            with pytest.raises(ValueError):
                hvd.broadcast_object(me, root_rank=0, process_set=odds)
        else:
            with pytest.raises(ValueError):
                hvd.broadcast_object(me, root_rank=1, process_set=odds)
        # Empty objects and None survive too; lengths vary by rank in allgather_object.
        assert hvd.broadcast_object(None if me else b"", root_rank=0, name="empty") == b""
        assert hvd.allgather_object("x" * me * 100) == ["x" * r * 100 for r in range(n)]
    finally:
        hvd.barrier()
        assert hvd.remove_process_set(odds)
