"""Adasum (op=hvd.Adasum): the compiled kernels in one process, then the per-rank suites
(tests/parallel/test_adasum.py, test_adasum_tf.py) at 2 (tiny fusion buffer), 4 and 8 ranks, at 3
ranks (Horovod's error on every call) and on 2 virtual nodes, and a digits training run
against op=hvd.Average."""
import ctypes
import importlib.util
import re
import sys

import numpy as np
import pytest
import torch

from launch import check_rank_summaries, run_ranks

from aiak_training.allreduce import _adasum_cpu as kernels
from aiak_training.common.dtypes import DataType

PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--rootdir",
          "tests/parallel"]
TORCH_SUITE = PYTEST + ["tests/parallel/test_adasum.py"]

# Storage types and how the rounding contract of csrc/adasum/adasum.h computes a scaled add:
# float64 in float64; float32 in float64 then rounded; the half types in float32 with float32
# coefficients, then rounded (torch rounds float32 -> half to nearest even, as the kernels).
TYPES = {"float16": (torch.float16, DataType.FLOAT16), "bfloat16": (torch.bfloat16,
                                                                     DataType.BFLOAT16),
         "float32": (torch.float32, DataType.FLOAT32), "float64": (torch.float64,
                                                                  DataType.FLOAT64)}


def expected_axpby(a: torch.Tensor, b: torch.Tensor, ca: float, cb: float) -> torch.Tensor:
    if a.dtype in (torch.float16, torch.bfloat16):
        fa, fb = np.float32(ca), np.float32(cb)
        out = fa * a.float().numpy() + fb * b.float().numpy()
        assert out.dtype == np.float32
        return torch.from_numpy(out).to(a.dtype)
    out = ca * a.double().numpy() + cb * b.double().numpy()
    return torch.from_numpy(out).to(a.dtype)


@pytest.fixture(params=kernels.supported_isas())
def isa(request):
    before = kernels.isa()
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(before)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 33, 1001])
@pytest.mark.parametrize("name", list(TYPES))
def test_kernels_match_numpy_on_every_isa(isa, name, n):
    dtype, code = TYPES[name]
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    a64, b64 = a.double().numpy(), b.double().numpy()
    got = kernels.dot_norms(a.data_ptr(), b.data_ptr(), n, int(code))
    want = (a64 @ b64, a64 @ a64, b64 @ b64)
    # float64 sums of exactly representable products, in another order: n ulps at most.
    bound = 2 * n * 2.0 ** -53 * np.array([np.abs(a64) @ np.abs(b64), want[1], want[2]])
    assert np.all(np.abs(np.array(got) - np.array(want)) <= bound), (got, want)
    ca, cb = 0.625, 1.0 / 3.0
    out = a.clone()
    kernels.axpby(out.data_ptr(), b.data_ptr(), n, int(code), ca, cb)
    # The same arithmetic on every ISA: bit for bit.
    assert torch.equal(out, expected_axpby(a, b, ca, cb))


def test_kernels_refuse_integer_types():
    t = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="float16, bfloat16, float32 or float64"):
        kernels.dot_norms(t.data_ptr(), t.data_ptr(), 4, int(DataType.INT32))


def test_c_abi():
    lib = ctypes.CDLL(kernels.__file__)
    lib.aiak_adasum_dot_norms.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int32, ctypes.POINTER(ctypes.c_double)]
    lib.aiak_adasum_combine.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int32, ctypes.c_double, ctypes.c_double,
                                        ctypes.c_double]
    a = torch.tensor([1.0, 2.0, 0.0, 4.0], dtype=torch.float32)
    b = torch.tensor([2.0, 0.0, 3.0, 1.0], dtype=torch.float32)
    out = (ctypes.c_double * 3)()
    assert lib.aiak_adasum_dot_norms(a.data_ptr(), b.data_ptr(), 4, int(DataType.FLOAT32),
                                     out) == 0
    assert list(out) == [6.0, 21.0, 14.0]
    # a' = (1 - 6/42) a + (1 - 6/28) b
    combined = a.clone()
    assert lib.aiak_adasum_combine(combined.data_ptr(), b.data_ptr(), 4, int(DataType.FLOAT32),
                                   6.0, 21.0, 14.0) == 0
    assert torch.equal(combined, expected_axpby(a, b, 1 - 6 / 42, 1 - 6 / 28))
    # Horovod's rule: a squared norm under 1e-8 keeps its coefficient at 1 (here: a + b).
    tiny = torch.full((4,), 1e-5, dtype=torch.float32)
    lib.aiak_adasum_combine(tiny.data_ptr(), b.data_ptr(), 4, int(DataType.FLOAT32),
                            float(tiny.double() @ b.double()), 4e-10, 14.0)
    cb = 1 - float(torch.full((4,), 1e-5, dtype=torch.float32).double() @ b.double()) / 28
    assert torch.equal(tiny, expected_axpby(torch.full((4,), 1e-5), b, 1.0, cb))
    assert lib.aiak_adasum_dot_norms(a.data_ptr(), b.data_ptr(), 4, int(DataType.INT32),
                                     out) == -1


# ---- per-rank suites ----------------------------------------------------------------------
# name: (ranks per node, virtual nodes, environment, pytest selection, tests each rank passes)
LAYOUTS = {
    "1rank": ([1], False, {}, [], 23),
    "4ranks": ([4], False, {}, [], 23),
    # 8 ranks on a 2-core machine are oversubscribed: a few reductions only.
    "8ranks": ([8], False, {}, ["-k", "matches_reference and float32 and 1000 or grouped "
                                      "or orthogonal"], 2),
    # Not a power of two: every Adasum call must raise Horovod's error.
    "3ranks": ([3], False, {}, ["-k", "matches_reference and float32 or grouped or async or "
                                      "optimizer and sgd"], 7),
    # 2 ranks with small tensors fused and larger ones reduced in place.
    "2ranks_tiny_fusion": ([2], False, {"HOROVOD_FUSION_THRESHOLD": "4096",
                                        "AIAK_ZERO_COPY_BYTES": "256"}, [], 23),
    # A hierarchical algorithm is selected for the set; Adasum still runs its own (flat) one.
    "2x2_virtual_nodes": ([2, 2], True, {"AIAK_TEST_LAYOUT": "2,2"},
                          ["-k", "matches_reference and float32 or grouped or large"], 5),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adasum_per_rank_suite(layout):
    nodes, virtual, env, extra, minimum = LAYOUTS[layout]
    proc = run_ranks(nodes, TORCH_SUITE + extra, env=env, virtual_hosts=virtual, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, sum(nodes), minimum)


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="TensorFlow is not installed (pip install -e '.[tensorflow]')")
@pytest.mark.parametrize("ranks", [2])
def test_adasum_tensorflow_per_rank_suite(ranks):
    proc = run_ranks([ranks], PYTEST + ["tests/parallel/test_adasum_tf.py"],
                     env={"AIAK_TEST_FRONTEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"},
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_rank_summaries(proc.stdout, ranks, 9)


def _accuracy(stdout: str) -> float:
    found = re.search(r"test accuracy: ([0-9.]+)%", stdout)
    assert found, stdout[-3000:]
    return float(found.group(1))


def test_digits_training_with_adasum_matches_average():
    """examples/pytorch_digits.py at 2 ranks: op=hvd.Adasum (delta optimizer, unscaled
    learning rate) reaches op=hvd.Average's test accuracy within 1 point."""
    runs = {}
    for label, flags in (("average", []), ("adasum", ["--use-adasum"])):
        proc = run_ranks([2], [sys.executable, "examples/pytorch_digits.py", *flags],
                         timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:]
        runs[label] = _accuracy(proc.stdout)
    assert runs["adasum"] >= runs["average"] - 1.0, runs
    assert runs["average"] > 90.0, runs  # both really trained
