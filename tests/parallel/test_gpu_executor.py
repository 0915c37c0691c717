"""The GPU executor's logic on every rank, without a GPU: the engine runs GPU responses with
host-memory stand-ins for libcudart and NCCL (benchmarks/jobs/gpu_fakes.py, shared with
benchmarks/gpu_host_cost_bench.py), and every result is checked against references computed
with plain torch.  Launched by tests/test_gpu_path.py at
2 ranks (NCCL path), 2 x 2 virtual nodes (hierarchical NCCL path) and with
AIAK_GPU_TRANSPORT=mpi (staged path).
"""
import ctypes
import itertools
import os

import pytest
import torch

import aiak_training.torch as hvd
from aiak_training.runtime import current
from aiak_training.runtime.entries import TensorEntry
from aiak_training.common.gpu import kernels
from aiak_training.common.messages import OpType, Request
from aiak_training.torch.submission import _DTYPES
from gpu_fakes import FakeLibrary, FakeRuntime, install, submit_allreduce
from helpers import (FLOAT_TYPES, INT_TYPES, cast_like, my_reducescatter_block, rank_data,
                     reference_reduce)

ALL_TYPES = INT_TYPES + FLOAT_TYPES
OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}
RUNTIME, LIBRARY = FakeRuntime(), FakeLibrary()
BATCHED = []
EVENTS = []
_names = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def fake_gpu():
    # AIAK_TEST_NO_KERNEL=1: as if setup.py had no nvcc (one cudaMemcpyAsync per tensor).
    kernel = None if os.environ.get("AIAK_TEST_NO_KERNEL") == "1" else True
    restore = install(RUNTIME, LIBRARY, kernel, _batched_copy)
    yield
    restore()


def _batched_copy(dsts, srcs, sizes, stream):
    """The kernel's effect; a launch of our own library, not a CUDA runtime call."""
    BATCHED.append(len(sizes))
    for d, s, n in zip(dsts, srcs, sizes):
        if n:
            ctypes.memmove(d, s, n)


def context():
    return current.engine().executor._gpu_executor._sets[0]


def run(op_type, tensors, outputs=None, name=None, ready_event=0, **fields):
    """Submit host tensors as if they were on cuda:0; return (outputs, results).  Names come
    from a counter that every rank advances alike, unless ``name`` is given.  The tensors'
    completion events are left in ``EVENTS``."""
    engine = current.engine()
    outputs = list(outputs) if outputs is not None else [None] * len(tensors)
    if op_type == OpType.ALLREDUCE:  # as the torch frontend submits it: lists, one wait
        names = [f"gpu_exec.{name}.{i}" if name else f"gpu_exec.{next(_names)}"
                 for i in range(len(tensors))]
        results, events = submit_allreduce(
            tensors, outputs, names, fields.get("reduce_op", hvd.Sum),
            fields.get("prescale", 1.0), fields.get("postscale", 1.0), ready_event)
        EVENTS[:] = events
        return outputs, results
    allocated = [None] * len(tensors)
    requests, entries = [], []
    for i, t in enumerate(tensors):
        tensor_name = f"gpu_exec.{name}.{i}" if name else f"gpu_exec.{next(_names)}"
        dt = _DTYPES[t.dtype]

        def allocate(shape, i=i, like=t):
            allocated[i] = torch.empty(shape, dtype=like.dtype)
            return allocated[i].data_ptr()
        requests.append(Request(rank=hvd.rank(), name=tensor_name, op_type=op_type,
                                dtype=int(dt), shape=tuple(t.shape), device=0, **fields))
        entries.append(TensorEntry(tensor_name, dt, tuple(t.shape), t.data_ptr(),
                                   outputs[i].data_ptr() if outputs[i] is not None else 0,
                                   allocate=allocate, keep=(t, outputs[i]), device=0,
                                   stream=0, ready_event=ready_event))
    handles = engine.enqueue(0, requests, entries)
    done = [engine.wait(h) for h in handles]
    assert all(h.event for h in done), "GPU ops complete with an event"
    EVENTS[:] = [h.event for h in done]
    outs = [o if o is not None else a for o, a in zip(outputs, allocated)]
    return outs, [h.result for h in done]


def everyone(shape, dtype, seed):
    return [rank_data(r, shape, dtype, seed) for r in range(hvd.size())]


def exact(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual, expected), f"\nactual={actual}\nexpected={expected}"


def test_transport_is_the_expected_one():
    run(OpType.ALLREDUCE, [torch.ones(2)], [torch.empty(2)], reduce_op=hvd.Sum)
    expected = os.environ.get("AIAK_TEST_GPU_TRANSPORT", "nccl")
    assert context().transport == expected.split("+")[0], context().reason
    assert context().hier == expected.endswith("+hier")
    assert (("global" in context().comms) == (context().transport == "nccl"))


@pytest.mark.parametrize("dtype", ALL_TYPES + [torch.bool])
@pytest.mark.parametrize("op", list(OPS))
def test_fused_and_direct_allreduce(dtype, op):
    if dtype == torch.bool and op == "average":
        return
    # Five small tensors share the fusion buffer; one of 16 KiB+ goes input -> output
    # (the driver sets AIAK_ZERO_COPY_BYTES=4096).
    shapes = [(3, 5), (7,), (1,), (2, 2, 2), (11,), (4101,)]
    groups = [everyone(s, dtype, seed=i) for i, s in enumerate(shapes)]
    mine = [g[hvd.rank()] for g in groups]
    before = [m.clone() for m in mine]
    BATCHED.clear()
    outs, _ = run(OpType.ALLREDUCE, mine, [torch.empty_like(m) for m in mine],
                  reduce_op=OPS[op])
    for out, g in zip(outs, groups):
        exact(out, reference_reduce(g, op))
    for m, b in zip(mine, before):
        assert torch.equal(m, b), "input modified"
    if context().transport == "nccl" and dtype != torch.int16:
        if os.environ.get("AIAK_TEST_NO_KERNEL") == "1":
            assert not BATCHED
        else:
            assert BATCHED and BATCHED[0] == 5, BATCHED  # the five small ones, in one launch


@pytest.mark.parametrize("dtype", ALL_TYPES)
def test_scale_factors(dtype):
    tensors = everyone((17,), dtype, seed=2)
    for pre, post in [(0.5, 1.0), (1.0, 0.25), (1.5, 2.0), (2.0, 0.5), (0.5, 2.0), (3.0, 2.0)]:
        outs, _ = run(OpType.ALLREDUCE, [tensors[hvd.rank()]],
                      [torch.empty_like(tensors[0])], reduce_op=hvd.Sum, prescale=pre,
                      postscale=post)
        scaled = [cast_like(t.to(torch.float64) * pre, dtype) for t in tensors]
        exact(outs[0], cast_like(reference_reduce(scaled, "sum").to(torch.float64) * post,
                                 dtype))


def test_in_place_allreduce():
    t = everyone((300,), torch.float32, seed=3)
    mine = t[hvd.rank()].clone()
    run(OpType.ALLREDUCE, [mine], [mine], reduce_op=hvd.Max)
    exact(mine, reference_reduce(t, "max"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool, torch.bfloat16])
@pytest.mark.parametrize("equal", [True, False])
def test_allgather(dtype, equal):
    tensors = [rank_data(r, (2 if equal else r % 3 + 1, 3), dtype, seed=4)
               for r in range(hvd.size())]
    outs, results = run(OpType.ALLGATHER, [tensors[hvd.rank()]])
    exact(outs[0], torch.cat(tensors))
    assert results[0] == tuple(torch.cat(tensors).shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int16, torch.uint8])
def test_broadcast_every_root(dtype):
    tensors = everyone((5, 2), dtype, seed=5)
    for root in range(hvd.size()):
        out = torch.empty_like(tensors[0])
        run(OpType.BROADCAST, [tensors[hvd.rank()]], [out], root=root)
        exact(out, tensors[root])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])
def test_alltoall_with_splits(dtype):
    n, me = hvd.size(), hvd.rank()
    splits_of = [[(src + dst) % 3 for dst in range(n)] for src in range(n)]
    data = [rank_data(src, (sum(splits_of[src]) + 1, 2), dtype, seed=6) for src in range(n)]
    outs, results = run(OpType.ALLTOALL, [data[me]], splits=tuple(splits_of[me]))
    pieces = [data[src][sum(splits_of[src][:me]):sum(splits_of[src][:me + 1])]
              for src in range(n)]
    exact(outs[0], torch.cat(pieces))
    assert results[0][1] == [splits_of[src][me] for src in range(n)]


@pytest.mark.parametrize("dtype", ALL_TYPES)
@pytest.mark.parametrize("op", ["sum", "average", "min", "max"])
@pytest.mark.parametrize("extra", [0, 1])
def test_reducescatter(dtype, op, extra):
    n, me = hvd.size(), hvd.rank()
    rows = 2 * n + extra
    tensors = everyone((rows, 3), dtype, seed=7)
    outs, _ = run(OpType.REDUCESCATTER, [tensors[me]], reduce_op=OPS[op])
    exact(outs[0], my_reducescatter_block(reference_reduce(tensors, op), me, n))


def test_joined_rank_contributes_zeros():
    n, me = hvd.size(), hvd.rank()
    if me == n - 1:
        hvd.join()
    else:
        x = torch.full((40,), 2.0)
        outs, _ = run(OpType.ALLREDUCE, [x], [torch.empty_like(x)], name="join",
                      reduce_op=hvd.Sum)
        exact(outs[0], torch.full((40,), 2.0 * (n - 1)))
        hvd.join()


def test_hierarchical_pipeline_runs_every_stage():
    if not context().hier:
        pytest.skip("not the hierarchical layout")
    comms = context().comms
    for c in comms.values():
        c.calls.clear()
    tensors = everyone((2001,), torch.float32, seed=8)  # 8004 bytes: reduced directly
    outs, _ = run(OpType.ALLREDUCE, [tensors[hvd.rank()]], [torch.empty(2001)],
                  reduce_op=hvd.Average)
    exact(outs[0], reference_reduce(tensors, "average"))
    # AIAK_HIER_GPU_CHUNK_BYTES=1024: chunks of 256 floats (even, for 2 local ranks); the
    # last has 209, whose odd element goes through the global communicator.
    kinds = lambda c: [k for k, _ in c.calls]  # noqa: E731
    assert kinds(comms["local"]) == ["reduce_scatter", "reduce_scatter"] + \
        ["allgather", "reduce_scatter"] * 6 + ["allgather", "allgather"]
    assert kinds(comms["cross"]) == ["allreduce"] * 8
    assert comms["global"].calls == [("allreduce", 1)]
    assert [n for k, n in comms["local"].calls if k == "reduce_scatter"] == [128] * 7 + [104]


def _grouped_allreduce_cost(n):
    """CUDA runtime calls made for one grouped allreduce of ``n`` small tensors (one fused
    response), with one ready event for the call as the torch frontend records it."""
    tensors = [everyone((5,), torch.float32, seed=20 + i) for i in range(n)]
    mine = [g[hvd.rank()] for g in tensors]
    ready = RUNTIME.record(0, uses=n)
    comm = context().comms.get("global")  # None on the staged path
    RUNTIME.calls.clear()
    if comm is not None:
        comm.calls.clear()
    outs, _ = run(OpType.ALLREDUCE, mine, [torch.empty_like(m) for m in mine],
                  reduce_op=hvd.Sum, ready_event=ready)
    for out, g in zip(outs, tensors):
        exact(out, reference_reduce(g, "sum"))
    assert ready not in RUNTIME.held, "the engine gives back every use of the ready event"
    assert len(set(EVENTS)) == 1 and EVENTS[0], "one completion event for the response"
    assert RUNTIME.held[EVENTS[0]] == n, "one use of it per tensor"
    for event in EVENTS:  # what the frontend's consume() does once per tensor
        RUNTIME.event_put(event)
    assert EVENTS[0] not in RUNTIME.held
    # 5 floats (20 bytes) take 32-byte slots; the last one is not padded.
    assert comm is None or comm.calls == [("allreduce", 8 * (n - 1) + 5)], comm.calls
    return dict(RUNTIME.calls)


def _first_gpu_op():
    """The GPU executor and its set context appear with the first GPU response."""
    run(OpType.ALLREDUCE, [torch.ones(2)], [torch.empty(2)], reduce_op=hvd.Sum)


def test_cuda_calls_of_a_grouped_allreduce_do_not_grow_with_its_tensors():
    _first_gpu_op()
    if context().hier or not kernels.library():
        pytest.skip("counts the flat NCCL and staged paths with the batched-copy kernel")
    _grouped_allreduce_cost(64)  # the fusion and staging buffers grow to their size, once
    few, many = _grouped_allreduce_cost(8), _grouped_allreduce_cost(64)
    assert few == many, (few, many)
    # Per response: the device made current, one wait for the call's ready event, one
    # completion event recorded.
    expected = {"set_device": 1, "wait_event": 1, "record": 1}
    if context().transport == "mpi":
        # Staged: one copy to pinned memory and one back, one wait for the first before
        # MPI reads the buffer, and an event that keeps the buffer until the second is done
        # (the next op waits on the previous one's).
        expected.update(memcpy_async=2, stream_synchronize=1, event_synchronize=1, record=2)
    assert many == expected, many


def test_direct_allreduces_of_a_response_are_one_nccl_group():
    _first_gpu_op()
    if context().transport != "nccl" or context().hier:
        pytest.skip("the flat NCCL path")
    # Three tensors of at least AIAK_ZERO_COPY_BYTES go input -> output, two small ones
    # share the fusion buffer; all four reductions are enqueued in one NCCL group.
    z = context().zero_copy_bytes // 4
    shapes = [(z,), (z + 476,), (z + 976,), (3,), (4,)]
    groups = [everyone(s, torch.float32, seed=40 + i) for i, s in enumerate(shapes)]
    mine = [g[hvd.rank()] for g in groups]
    comm = context().comms["global"]
    comm.calls.clear()
    LIBRARY.groups.clear()
    outs, _ = run(OpType.ALLREDUCE, mine, [torch.empty_like(m) for m in mine],
                  reduce_op=hvd.Average)
    for out, g in zip(outs, groups):
        exact(out, reference_reduce(g, "average"))
    assert comm.calls == [("allreduce", z), ("allreduce", z + 476), ("allreduce", z + 976),
                          ("allreduce", 8)], comm.calls  # 3 + 4 floats in 16-byte slots
    assert LIBRARY.groups == [4], LIBRARY.groups


class _ClaimsCuda(torch.Tensor):
    """A host tensor that says it is on cuda:0: the frontend's device checks run on it
    without a GPU (nothing here reaches the engine)."""
    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)
    device = property(lambda self: torch.device("cuda", 0))


@pytest.mark.parametrize("cuda_first", [True, False])
def test_grouped_call_with_cuda_and_cpu_tensors_names_both_devices(cuda_first):
    cuda = torch.Tensor._make_subclass(_ClaimsCuda, torch.ones(3))
    tensors = [cuda, torch.ones(3)] if cuda_first else [torch.ones(3), cuda]
    expected = "got cuda:0 and cpu tensors" if cuda_first else "got cpu and cuda:0 tensors"
    with pytest.raises(ValueError, match=expected):
        hvd.grouped_allreduce_(tensors)
    with pytest.raises(ValueError, match=expected):
        hvd.grouped_allreduce(tensors)
    # Nothing was submitted: the next collective on every rank still matches.
    outs, _ = run(OpType.ALLREDUCE, [torch.ones(2)], [torch.empty(2)], reduce_op=hvd.Sum)
    exact(outs[0], torch.full((2,), float(hvd.size())))


def test_fused_allreduce_reaches_the_executor_as_one_call_of_lists(monkeypatch):
    """CUDA allreduces are fused by the C++ thread and handed over as one FusedAllreduce:
    the lane holds no entry for them, and the executor is called once per fused response,
    not per tensor."""
    _first_gpu_op()
    executor = current.engine().executor
    calls = []
    real = executor.gpu_allreduce

    def spy(state, payload):
        assert not state.entries, "the lane holds no entry for a CUDA allreduce"
        calls.append(list(payload[0]))
        return real(state, payload)
    monkeypatch.setattr(executor, "gpu_allreduce", spy)
    held = dict(RUNTIME.held)
    mine = [torch.full((i + 1,), float(hvd.rank() + i)) for i in range(40)]
    outs, results = run(OpType.ALLREDUCE, mine, [torch.empty_like(m) for m in mine],
                        name="as_lists", reduce_op=hvd.Sum)
    n = hvd.size()
    for i, out in enumerate(outs):
        exact(out, torch.full((i + 1,), float(sum(range(n)) + n * i)))
    assert results == [None] * 40
    assert calls == [[f"gpu_exec.as_lists.{i}" for i in range(40)]], calls
    (event,) = set(EVENTS)  # one completion event for the fused response, a use per tensor
    assert RUNTIME.held[event] == 40
    RUNTIME.event_put(event, 40)  # what the frontend's synchronize gives back
    # Nothing else is held now that was not before (the staged path swaps the one event that
    # guards its pinned buffer for a new one).
    assert sum(RUNTIME.held.values()) == sum(held.values()), (RUNTIME.held, held)


def test_mismatched_shapes_fail_on_every_rank_and_the_engine_goes_on():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    _first_gpu_op()
    engine = current.engine()
    bad = torch.ones(2 + (hvd.rank() == 0))
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched allreduce tensor shapes"):
        run(OpType.ALLREDUCE, [torch.ones(4), bad], [torch.empty(4), torch.empty_like(bad)],
            name="mismatch", reduce_op=hvd.Sum)
    # Both handles were waited on and forgotten, and the names can be used again.
    assert engine.open_handles() == 0
    outs, _ = run(OpType.ALLREDUCE, [torch.ones(4), torch.ones(2)],
                  [torch.empty(4), torch.empty(2)], name="mismatch", reduce_op=hvd.Sum)
    exact(outs[1], torch.full((2,), float(hvd.size())))


def test_wait_all_forgets_every_handle_when_one_is_unknown():
    _first_gpu_op()
    engine = current.engine()
    x = torch.ones(3)
    handles = engine.submit_allreduces(0, hvd.rank(), ["wait_all.0"], [int(_DTYPES[x.dtype])],
                                      [(3,)], [x.data_ptr()], [x.data_ptr()], hvd.Sum, 1.0,
                                      1.0, x)
    with pytest.raises(ValueError, match=f"Handle {10 ** 9} was not created"):
        engine.wait_all(handles + [10 ** 9])
    assert engine.open_handles() == 0
    exact(x, torch.full((3,), float(hvd.size())))
