"""Collectives on CUDA tensors, checked on every rank against CPU references.

Run under an MPI launcher by tests/test_cuda.py (1 rank on NCCL; 2 and 4 ranks sharing one
GPU, which takes the staged MPI path; several GPUs on NCCL where the machine has them).
Skipped without a CUDA device.
"""
import os

import pytest
import torch

import aiak_training.torch as hvd
from aiak_training.runtime import current
from helpers import (FLOAT_TYPES, INT_TYPES, cast_like, my_reducescatter_block, rank_data,
                     reference_reduce)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}
ALL_TYPES = INT_TYPES + FLOAT_TYPES


@pytest.fixture(scope="module", autouse=True)
def device():
    # The global rank, not the local one: virtual nodes on one machine must not share GPUs.
    index = hvd.rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def everyone(shape, dtype, seed=0):
    return [rank_data(r, shape, dtype, seed) for r in range(hvd.size())]


def gpu(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.device("cuda", torch.cuda.current_device()))


def assert_same(actual, expected, tolerant=False):
    assert actual.is_cuda and actual.device.index == torch.cuda.current_device(), actual.device
    actual = actual.cpu()
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if tolerant and expected.is_floating_point():
        # Average over a size that is not a power of two: NCCL may round 1/size differently.
        rtol = 1e-2 if expected.dtype in (torch.float16, torch.bfloat16) else 1e-6
        assert torch.allclose(actual.double(), expected.double(), rtol=rtol, atol=rtol), \
            f"\nactual={actual}\nexpected={expected}"
    else:
        assert torch.equal(actual, expected), f"\nactual={actual}\nexpected={expected}"


def inexact_average() -> bool:
    return hvd.size() & (hvd.size() - 1) != 0


def test_transport_is_the_expected_one():
    """The driver says which path this layout must take (AIAK_TEST_GPU_TRANSPORT: nccl, mpi
    or nccl+hier), so a silent fallback cannot pass for the path under test."""
    expected = os.environ.get("AIAK_TEST_GPU_TRANSPORT")
    if not expected:
        pytest.skip("the driver did not name a transport")
    hvd.allreduce(gpu(torch.ones(1)), name="cuda.transport_probe")
    ctx = current.engine().executor._gpu_executor._sets[0]
    assert ctx.transport == expected.split("+")[0], ctx.reason
    assert ctx.hier == expected.endswith("+hier"), ctx.reason


# ---- allreduce ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_TYPES + [torch.bool])
@pytest.mark.parametrize("op", list(OPS))
def test_allreduce_every_dtype_and_op(dtype, op):
    if dtype == torch.bool and op == "average":
        return  # rejected before submission, as on the CPU
    tensors = everyone((3, 5), dtype, seed=1)
    mine = gpu(tensors[hvd.rank()])
    before = mine.clone()
    out = hvd.allreduce(mine, op=OPS[op], name=f"cuda.ar.{dtype}.{op}")
    assert_same(out, reference_reduce(tensors, op), tolerant=op == "average" and inexact_average())
    assert torch.equal(mine, before), "out-of-place allreduce modified its input"


@pytest.mark.parametrize("dtype", ALL_TYPES)
def test_allreduce_prescale_postscale(dtype):
    tensors = everyone((17,), dtype, seed=2)
    for pre, post in [(0.5, 1.0), (1.0, 0.25), (1.5, 2.0), (2.0, 0.5), (0.5, 2.0)]:
        out = hvd.allreduce(gpu(tensors[hvd.rank()]), op=hvd.Sum, prescale_factor=pre,
                            postscale_factor=post)
        scaled = [cast_like(t.to(torch.float64) * pre, dtype) for t in tensors]
        summed = reference_reduce(scaled, "sum").to(torch.float64)
        assert_same(out, cast_like(summed * post, dtype))


def test_inplace_grouped_and_async_variants():
    tensors = [everyone((5, 4), torch.float32, seed=3 + i) for i in range(3)]
    mine = [gpu(t[hvd.rank()]) for t in tensors]
    outs = hvd.grouped_allreduce(mine, op=hvd.Sum)
    for out, t in zip(outs, tensors):
        assert_same(out, reference_reduce(t, "sum"))
    hvd.grouped_allreduce_(mine, op=hvd.Sum)
    for m, t in zip(mine, tensors):
        assert_same(m, reference_reduce(t, "sum"))
    x = gpu(everyone((7,), torch.float64, seed=6)[hvd.rank()])
    handle = hvd.allreduce_async_(x, op=hvd.Max)
    assert hvd.synchronize(handle) is x
    assert_same(x, reference_reduce(everyone((7,), torch.float64, seed=6), "max"))


def test_many_small_tensors_fuse_and_large_ones_go_direct():
    # 1 KiB tensors share the fusion buffer; 4 MiB ones are reduced input -> output.
    small = [everyone((256,), torch.float32, seed=100 + i) for i in range(40)]
    large = [everyone((1 << 20,), torch.float32, seed=200 + i) for i in range(2)]
    handles = [hvd.allreduce_async(gpu(t[hvd.rank()]), op=hvd.Sum, name=f"cuda.fuse.{i}")
               for i, t in enumerate(small + large)]
    for h, t in zip(handles, small + large):
        assert_same(hvd.synchronize(h), reference_reduce(t, "sum"))


def test_mixed_dtypes_in_one_group():
    dts = [torch.float16, torch.bfloat16, torch.int64, torch.float32, torch.int16]
    tensors = [everyone((6,), dt, seed=10 + i) for i, dt in enumerate(dts)]
    outs = hvd.grouped_allreduce([gpu(t[hvd.rank()]) for t in tensors], op=hvd.Sum)
    for out, t in zip(outs, tensors):
        assert_same(out, reference_reduce(t, "sum"))


def test_empty_and_scalar():
    assert_same(hvd.allreduce(gpu(torch.zeros(0)), op=hvd.Sum), torch.zeros(0))
    out = hvd.allreduce(gpu(torch.tensor(float(hvd.rank() + 1))), op=hvd.Sum)
    assert_same(out, torch.tensor(float(sum(range(1, hvd.size() + 1)))))


# ---- stream ordering ------------------------------------------------------------------------
def test_collective_waits_for_the_producer_stream():
    """The input is written by a slow kernel on a side stream; the collective, submitted from
    that stream without any synchronize, must see the final values."""
    side = torch.cuda.Stream()
    x = gpu(torch.zeros(1 << 20))
    side.wait_stream(torch.cuda.current_stream())  # x's allocation and copy came first
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the fill
        x.fill_(hvd.rank() + 1.0)
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="cuda.order.producer")
        out = hvd.synchronize(handle)
        total = out.sum().item()  # consumed on the same stream
    assert total == float(sum(range(1, hvd.size() + 1))) * (1 << 20)


def test_consumer_stream_sees_the_result_without_host_sync():
    consumer = torch.cuda.Stream()
    x = gpu(torch.full((1 << 18,), float(hvd.rank())))
    handle = hvd.allreduce_async_(x, op=hvd.Sum, name="cuda.order.consumer")
    with torch.cuda.stream(consumer):
        hvd.synchronize(handle)  # makes *this* stream wait for the engine's
        y = x * 2
    consumer.synchronize()
    assert torch.equal(y.cpu(), torch.full((1 << 18,), 2.0 * sum(range(hvd.size()))))


def test_poll_turns_true_once_done_on_the_device():
    x = gpu(torch.ones(1024))
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="cuda.poll")
    while not hvd.poll(handle):
        pass
    assert_same(hvd.synchronize(handle), torch.full((1024,), float(hvd.size())))


# ---- allgather / broadcast / alltoall / reducescatter ---------------------------------------
@pytest.mark.parametrize("dtype", ALL_TYPES + [torch.bool])
def test_allgather_variable_first_dimension(dtype):
    tensors = [rank_data(r, (r % 3 + 1, 4, 2), dtype, seed=20) for r in range(hvd.size())]
    out = hvd.allgather(gpu(tensors[hvd.rank()]), name=f"cuda.ag.{dtype}")
    assert_same(out, torch.cat(tensors, 0))


def test_allgather_equal_first_dimension():
    tensors = everyone((3, 2), torch.float32, seed=21)
    assert_same(hvd.allgather(gpu(tensors[hvd.rank()])), torch.cat(tensors, 0))


@pytest.mark.parametrize("dtype", ALL_TYPES + [torch.bool])
def test_broadcast_from_every_root(dtype):
    tensors = everyone((4, 3), dtype, seed=40)
    for root in range(hvd.size()):
        mine = gpu(tensors[hvd.rank()])
        out = hvd.broadcast(mine, root, name=f"cuda.bc.{dtype}.{root}")
        assert_same(out, tensors[root])
        assert torch.equal(mine.cpu(), tensors[hvd.rank()])
        hvd.broadcast_(mine, root)
        assert_same(mine, tensors[root])


def test_alltoall_with_and_without_splits():
    n, me = hvd.size(), hvd.rank()
    tensors = [torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) + 1000 * r
               for r in range(n)]
    out = hvd.alltoall(gpu(tensors[me]))
    assert_same(out, torch.cat([tensors[src][2 * me:2 * me + 2] for src in range(n)]))
    splits_of = [[(src + dst) % 3 for dst in range(n)] for src in range(n)]
    data = [rank_data(src, (sum(splits_of[src]) + 1, 2), torch.int32, seed=50)
            for src in range(n)]
    out, received = hvd.alltoall(gpu(data[me]), splits=splits_of[me])
    pieces = [data[src][sum(splits_of[src][:me]):sum(splits_of[src][:me + 1])]
              for src in range(n)]
    assert_same(out, torch.cat(pieces))
    assert torch.equal(received, torch.tensor([splits_of[s][me] for s in range(n)],
                                              dtype=torch.int32))


@pytest.mark.parametrize("dtype", ALL_TYPES)
@pytest.mark.parametrize("op", ["sum", "average", "min", "max"])
@pytest.mark.parametrize("extra_row", [0, 1])
def test_reducescatter_even_and_uneven(dtype, op, extra_row):
    n, me = hvd.size(), hvd.rank()
    rows = 2 * n + extra_row
    tensors = everyone((rows, 3), dtype, seed=60)
    out = hvd.reducescatter(gpu(tensors[me]), op=OPS[op], name=f"cuda.rs.{dtype}.{op}.{rows}")
    full = reference_reduce(tensors, op)
    assert_same(out, my_reducescatter_block(full, me, n),
                tolerant=op == "average" and inexact_average())


# ---- errors and training --------------------------------------------------------------------
def test_cpu_gpu_mismatch_raises_on_every_rank():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    t = torch.ones(4)
    if hvd.rank() == 0:
        t = gpu(t)
    with pytest.raises(hvd.HorovodInternalError, match="CPU/GPU device selection"):
        hvd.allreduce(t, name="cuda.device_mismatch")


def test_grouped_op_rejects_mixed_devices():
    with pytest.raises(ValueError, match="got cpu and cuda:[0-9]+ tensors mixed"):
        hvd.grouped_allreduce([torch.ones(2), gpu(torch.ones(2))])


def test_join_contributes_zeros_on_the_device():
    n, me = hvd.size(), hvd.rank()
    if me == n - 1:
        last = hvd.join(torch.cuda.current_device())
    else:
        out = hvd.allreduce(gpu(torch.full((4,), 2.0)), op=hvd.Sum, name="cuda.join_ar")
        assert_same(out, torch.full((4,), 2.0 * (n - 1)))
        last = hvd.join()
    lasts = hvd.allgather_object(last)
    assert len(set(lasts)) == 1 and 0 <= lasts[0] < n


def test_distributed_optimizer_matches_cpu_training():
    """The same model trained with CUDA tensors and with CPU tensors ends up equal."""
    def train(dev):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 2)).to(dev).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       op=hvd.Average)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        g = torch.Generator().manual_seed(hvd.rank())
        for _ in range(5):
            x = torch.randn(4, 8, generator=g, dtype=torch.float64).to(dev)
            y = torch.randn(4, 2, generator=g, dtype=torch.float64).to(dev)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]
    on_gpu = train(torch.device("cuda", torch.cuda.current_device()))
    on_cpu = train(torch.device("cpu"))
    for a, b in zip(on_gpu, on_cpu):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (a - b).abs().max()
