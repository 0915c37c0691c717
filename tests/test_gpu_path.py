"""The GPU data path's host-side logic, which runs (and is checked) without a GPU: how a
reduction maps onto NCCL, scalar encodings, settings, device-mismatch errors, chunking, and
the ctypes bindings where the libraries are installed.  The device side is in
tests/test_cuda.py."""
import ctypes
import struct
import sys

import numpy as np
import pytest
import torch

from aiak_training.allreduce.hier_pipelined import chunk_spans
from aiak_training.common.config import Config
from aiak_training.common.dtypes import DataType as D
from aiak_training.common.dtypes import ReduceOp as R
from aiak_training.common.gpu import nccl
from aiak_training.common.host import build_info
from launch import check_rank_summaries, run_ranks

V = 23203  # an NCCL 2.32 version code


@pytest.mark.parametrize("dtype, op, pre, post, size, expected", [
    (D.FLOAT32, R.AVERAGE, 1.0, 1.0, 4, (nccl.AVG, None)),
    (D.INT64, R.AVERAGE, 1.0, 1.0, 4, (nccl.AVG, None)),
    (D.FLOAT32, R.SUM, 1.0, 1.0, 4, (nccl.SUM, None)),
    (D.FLOAT16, R.AVERAGE, 2.0, 1.0, 4, (nccl.SUM, 0.5)),
    (D.FLOAT32, R.AVERAGE, 1.0, 3.0, 2, (nccl.SUM, 1.5)),
    (D.FLOAT64, R.SUM, 1.5, 2.0, 4, (nccl.SUM, 3.0)),
    (D.FLOAT32, R.SUM, 0.5, 2.0, 4, (nccl.SUM, None)),       # factors cancel
    (D.INT32, R.SUM, 3.0, 2.0, 4, (nccl.SUM, 6.0)),          # integral factors fold
    (D.INT32, R.SUM, 1.5, 2.0, 4, None),                     # truncation after 1.5x
    (D.INT32, R.SUM, 1.0, 0.5, 4, None),
    (D.INT32, R.SUM, 0.5, 2.0, 4, None),                     # cancel, but 0.5x truncates
    (D.INT64, R.SUM, 2.0, 1.0, 4, (nccl.SUM, 2.0)),
    (D.INT32, R.AVERAGE, 2.0, 1.0, 4, None),
    (D.FLOAT32, R.MAX, 1.0, 1.0, 4, (nccl.MAX, None)),
    (D.FLOAT32, R.MIN, 2.0, 1.0, 4, None),                   # no factors on min/max/product
    (D.INT8, R.PRODUCT, 1.0, 1.0, 4, (nccl.PROD, None)),
    (D.BOOL, R.SUM, 1.0, 1.0, 4, (nccl.MAX, None)),          # logical or
    (D.BOOL, R.PRODUCT, 1.0, 1.0, 4, (nccl.MIN, None)),      # logical and
    (D.INT16, R.SUM, 1.0, 1.0, 4, None),                     # NCCL has no 16-bit integers
    (D.UINT16, R.SUM, 1.0, 1.0, 4, None),
])
def test_plan_reduction(dtype, op, pre, post, size, expected):
    assert nccl.plan_reduction(dtype, op, pre, post, size, V) == expected


def test_plan_reduction_respects_old_nccl():
    assert nccl.plan_reduction(D.FLOAT32, R.AVERAGE, 1.0, 1.0, 4, 20900) is None  # no ncclAvg
    assert nccl.plan_reduction(D.FLOAT32, R.SUM, 2.0, 1.0, 4, 21000) is None      # no PreMulSum
    assert nccl.plan_reduction(D.FLOAT32, R.SUM, 1.0, 1.0, 4, 20900) == (nccl.SUM, None)


# 1 + 2**-11 + 2**-40 rounds up to a float16 directly, but to a tie (and down) via float32,
# which is how torch, Horovod's scale kernels and NCCL's ncclAvg round a factor.
@pytest.mark.parametrize("value", [0.5, 1.0 / 3.0, 3.0, 1e-3, 65504.0, 1 + 2**-11 + 2**-40])
def test_pre_mul_scalars_encode_like_torch(value):
    half = nccl.scalar(value, nccl.FLOAT16)
    assert half.value == struct.unpack("<H", torch.tensor(value, dtype=torch.float16).numpy()
                                       .tobytes())[0]
    bf16 = nccl.scalar(value, nccl.BFLOAT16)
    assert bf16.value == torch.tensor(value).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF
    assert nccl.scalar(value, nccl.FLOAT32).value == np.float32(value)
    assert nccl.scalar(value, nccl.FLOAT64).value == value


def test_integer_scalars_must_be_integral():
    assert nccl.scalar(3.0, nccl.INT32).value == 3
    assert isinstance(nccl.scalar(3.0, nccl.UINT8), ctypes.c_uint8)
    assert nccl.scalar(2.5, nccl.INT64) is None


def test_nccl_dtype_coverage():
    assert all(nccl.supports(d) for d in (D.UINT8, D.INT8, D.INT32, D.INT64, D.FLOAT16,
                                          D.BFLOAT16, D.FLOAT32, D.FLOAT64, D.BOOL))
    assert not nccl.supports(D.INT16) and not nccl.supports(D.UINT16)


@pytest.mark.parametrize("env, expected", [
    ({}, "nccl"),
    ({"AIAK_GPU_TRANSPORT": "mpi"}, "mpi"),
    ({"HOROVOD_GPU_OPERATIONS": "MPI"}, "mpi"),
    ({"HOROVOD_GPU_ALLREDUCE": "MPI"}, "mpi"),
    ({"HOROVOD_GPU_OPERATIONS": "NCCL"}, "nccl"),
    ({"HOROVOD_GPU_OPERATIONS": "MPI", "AIAK_GPU_TRANSPORT": "nccl"}, "nccl"),
])
def test_gpu_transport_setting(monkeypatch, env, expected):
    for name in ("AIAK_GPU_TRANSPORT", "HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert Config.from_env().gpu_transport == expected


@pytest.mark.parametrize("name, value", [("AIAK_GPU_TRANSPORT", "gloo"),
                                         ("HOROVOD_GPU_OPERATIONS", "DDL")])
def test_bad_gpu_transport_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        Config.from_env()


@pytest.mark.parametrize("nranks", [2, 3])
def test_cpu_gpu_mismatch_is_an_error_on_every_rank(nranks):
    proc = run_ranks([nranks], [sys.executable, "tests/scripts/device_mismatch.py"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count("device mismatch refused") == nranks, proc.stdout[-3000:]


@pytest.mark.parametrize("count, itemsize, chunk, align", [
    (0, 4, 64, 1), (10, 4, 64, 1), (1000, 4, 64, 1), (1001, 2, 100, 4), (7, 8, 8, 4),
    (1 << 20, 4, 4 << 20, 8)])
def test_chunk_spans_cover_the_buffer(count, itemsize, chunk, align):
    spans = list(chunk_spans(count, itemsize, chunk, align))
    assert sum(n for _, n in spans) == count
    assert all(first == sum(n for _, n in spans[:i]) for i, (first, _) in enumerate(spans))
    step = max(align, (max(1, chunk // itemsize) // align) * align)
    assert all(n == step for _, n in spans[:-1]) and step % align == 0


def test_check_build_reports_the_gpu_path():
    from aiak_training.runner.cli.check_build import check_build_text
    text = check_build_text()
    assert "CUDA runtime:" in text and "GPU collectives:" in text
    if build_info.nccl_built():
        assert "GPU collectives:          NCCL" in text
    else:
        assert "NCCL not found" in text


def test_nccl_binding_where_installed():
    try:
        lib = nccl.library()
    except nccl.NcclError as exc:
        assert "AIAK_NCCL_LIBRARY" in str(exc)  # the error says how to fix it
        pytest.skip(f"NCCL is not installed: {exc}")
    assert lib.version == build_info.nccl_built()
    uid = lib.unique_id()  # needs no GPU
    assert len(uid) == 128 and uid != bytes(128)


def test_batched_copy_kernel_validates_arguments_without_a_gpu():
    """The kernel library (built by setup.py where nvcc exists) loads without a driver and
    rejects bad arguments before touching a device; n = 0 launches nothing."""
    from aiak_training.common.gpu import kernels
    lib = kernels.library()
    if lib is None:
        pytest.skip(f"CUDA kernel library not built: {kernels.error()}")
    assert lib.aiak_batched_copy_cuda(0, None, None, None, None) == 0
    assert lib.aiak_batched_copy_cuda(-1, None, None, None, None) != 0
    assert b"bad arguments" in lib.aiak_batched_copy_cuda_last_error()
    one = (ctypes.c_void_p * 1)(None)
    assert lib.aiak_batched_copy_cuda(1, one, one, (ctypes.c_int64 * 1)(-5), None) != 0
    assert b"nbytes[0] < 0" in lib.aiak_batched_copy_cuda_last_error()
    with pytest.raises(kernels.KernelError, match="bad arguments|nbytes"):
        kernels.batched_copy([0], [0], [-1], 0)


FAKE_SUITE = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
              "--rootdir", "tests/parallel", "tests/parallel/test_gpu_executor.py"]
SMALL = {"AIAK_ZERO_COPY_BYTES": "4096", "AIAK_HIER_GPU_CHUNK_BYTES": "1024"}


@pytest.mark.parametrize("layout", ["2ranks_nccl", "2x2_virtual_nodes_hier", "2ranks_staged",
                                    "4ranks_nccl", "2ranks_nccl_no_kernel"])
def test_gpu_executor_logic_with_host_fakes(layout):
    """The GPU executor end to end on stand-ins for libcudart and NCCL (host memory, MPI):
    fusion, layouts, reduction plans, the hierarchical pipeline and the staged path, exact on
    every rank.  CUDA and NCCL themselves are tested in tests/test_cuda.py, on a GPU."""
    # (ranks per node, virtual nodes, environment, tests each rank passes)
    nodes, virtual, env, passes = {
        "2ranks_nccl": ([2], False, {"AIAK_TEST_GPU_TRANSPORT": "nccl"}, 154),
        "4ranks_nccl": ([4], False, {"AIAK_TEST_GPU_TRANSPORT": "nccl"}, 154),
        "2x2_virtual_nodes_hier": ([2, 2], True, {"AIAK_TEST_GPU_TRANSPORT": "nccl+hier",
                                                  "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                                                  "AIAK_TEST_LAYOUT": "2,2"}, 153),
        "2ranks_staged": ([2], False, {"AIAK_TEST_GPU_TRANSPORT": "mpi",
                                       "AIAK_GPU_TRANSPORT": "mpi"}, 153),
        "2ranks_nccl_no_kernel": ([2], False, {"AIAK_TEST_GPU_TRANSPORT": "nccl",
                                               "AIAK_TEST_NO_KERNEL": "1"}, 153),
    }[layout]
    proc = run_ranks(nodes, FAKE_SUITE, env=dict(SMALL, **env), virtual_hosts=virtual)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, sum(nodes), passes)


class _FakeCudart:
    """Just enough of libcudart's C interface for :class:`cudart.Runtime`'s event pool: events
    are numbered, records are logged as (event, stream)."""

    def __init__(self):
        self.records = []
        self.created = 0

        def create(ref, _flags):
            self.created += 1
            ref._obj.value = 0x1000 + self.created
            return 0

        def record(event, stream):
            self.records.append((event.value, stream.value))
            return 0
        self.cudaEventCreateWithFlags = create
        self.cudaEventRecord = record
        self.cudaGetErrorString = lambda err: b"fake error"

    def __getattr__(self, name):  # every other call succeeds and does nothing
        def call(*_args):
            return 0
        setattr(self, name, call)
        return call


def test_shared_event_returns_to_the_pool_with_its_last_use():
    """One event recorded for a whole call (or fused response) is handed out once per
    tensor; it must not be reused, and so re-recorded, before every holder gave it back."""
    from aiak_training.common.gpu.cudart import Runtime
    lib = _FakeCudart()
    rt = Runtime(lib, "fake")
    shared = rt.record(7, uses=3)
    assert lib.records == [(shared, 7)]
    rt.event_put(shared)
    rt.event_put(shared)
    other = rt.record(8)  # two of three uses back: the pool must not hand it out yet
    assert other != shared and lib.created == 2
    rt.event_put(shared)
    assert rt.record(9) == shared and lib.created == 2  # back in the pool, reused
    rt.event_put(shared)
    rt.event_put(other)
    assert sorted([rt.event_get(), rt.event_get()]) == sorted([shared, other])


def test_uses_given_back_together_count_as_many():
    """synchronize gives a fused response's event back once with the count of its tensors
    (event_put(event, uses)): the event returns to the pool with exactly its last use."""
    from aiak_training.common.gpu.cudart import Runtime
    lib = _FakeCudart()
    rt = Runtime(lib, "fake")
    shared = rt.record(7, uses=5)
    rt.event_put(shared, 4)
    assert rt.record(8) != shared  # one use still out
    rt.event_put(shared, 1)
    assert rt.record(9) == shared and lib.created == 2
