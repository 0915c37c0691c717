"""Single-process unit tests of the engine's building blocks."""
import numpy as np
import pytest
import torch

from aiak_training.common import native
from aiak_training.common.config import Config
from aiak_training.common.dtypes import DataType, ReduceOp
from aiak_training.common.messages import OpType, Response

HALF = {DataType.FLOAT16: torch.float16, DataType.BFLOAT16: torch.bfloat16}


def _special_floats():
    g = torch.Generator().manual_seed(0)
    vals = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-8, 1e-5, 1e-2, 1, 1e3, 6e4, 1e6)])
    extra = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65520.0, 65519.99,
                          6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-45, 3.0e38])
    return torch.cat([vals, extra]).float()


@pytest.mark.parametrize("dtype", list(HALF))
def test_half_conversions_match_torch_rounding(dtype):
    # Rounding through our scale kernel (factor 1 in float) must equal torch's conversion.
    x = _special_floats()
    roundtrip = native.half_roundtrip if dtype == DataType.FLOAT16 else native.bf16_roundtrip
    ours = torch.tensor([roundtrip(float(v)) for v in x[::97].tolist()])
    ref = x[::97].to(HALF[dtype]).float()
    assert torch.equal(ours, ref)


def test_half_conversions_of_nan_match_torch():
    # float16 keeps the sign and top payload bits (F16C's rule, which torch follows); bfloat16
    # NaN is 0x7FC0, as c10::BFloat16's scalar conversion gives.
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FA00000, 0x7FFFFFFF],
                    dtype=np.uint32).view(np.float32)
    refs = torch.from_numpy(nans).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    for x, ref in zip(nans, refs):
        # Our widening is exact, so numpy's narrowing of it gives back our half's bits.
        ours = np.float32(native.half_roundtrip(float(x))).astype(np.float16).view(np.uint16)
        assert ours == ref, (hex(int(x.view(np.uint32))), hex(int(ours)), hex(int(ref)))
        assert np.float32(native.bf16_roundtrip(float(x))).view(np.uint32) == 0x7FC00000


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
def test_half_reduce_kernel(dtype, op):
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(1001, generator=g) * 10).to(HALF[dtype])
    b = (torch.randn(1001, generator=g) * 10).to(HALF[dtype])
    dst = b.clone()
    native.reduce(a.data_ptr(), dst.data_ptr(), a.numel(), int(dtype), int(op))
    af, bf = a.float(), b.float()
    ref = {ReduceOp.SUM: af + bf, ReduceOp.MIN: torch.minimum(af, bf),
           ReduceOp.MAX: torch.maximum(af, bf), ReduceOp.PRODUCT: af * bf}[op]
    assert torch.equal(dst, ref.to(HALF[dtype]))


# ---- scaling: Horovod 0.28.1's CPU arithmetic, against numpy -------------------------------
NEAR_1_5 = 1.5 + 0.99 * 2.0 ** -24  # 1.5 in float32, not in float64
FACTORS = [NEAR_1_5, 1.0 / 3.0, 0.1, -0.7, 2.0 / 3.0, 1e-3, 3.0]
INT_NP = {DataType.UINT8: np.uint8, DataType.INT8: np.int8, DataType.UINT16: np.uint16,
          DataType.INT16: np.int16, DataType.INT32: np.int32, DataType.INT64: np.int64}
NP = {**INT_NP, DataType.FLOAT16: np.float16, DataType.BFLOAT16: np.uint16,
      DataType.FLOAT32: np.float32, DataType.FLOAT64: np.float64}


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """torch's float32 -> bfloat16 conversion (round to nearest even), as raw bits."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16) \
        .view(torch.int16).numpy().view(np.uint16)


def _scale_inputs(dtype: DataType, factor: float) -> np.ndarray:
    """Every value of the small types (every non-NaN one of the halves), a random sample of
    the others; integers only where the product stays in range."""
    rng = np.random.default_rng(int(dtype))
    if dtype in (DataType.FLOAT16, DataType.BFLOAT16):
        bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
        f32 = bits.view(np.float16).astype(np.float32) if dtype == DataType.FLOAT16 \
            else _bf16_to_f32(bits)
        return bits[~np.isnan(f32)].view(NP[dtype])
    if dtype == DataType.FLOAT32:
        bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        return x[~np.isnan(x)]
    if dtype == DataType.FLOAT64:
        return rng.standard_normal(50_000) * 10.0 ** rng.integers(-30, 30, 50_000)
    info = np.iinfo(INT_NP[dtype])
    if info.bits <= 16:
        x = np.arange(info.min, info.max + 1, dtype=np.int64)
    else:
        x = np.concatenate([np.arange(-300, 300), rng.integers(info.min, info.max, 50_000)])
    with np.errstate(over="ignore"):
        wide = np.trunc(x.astype(np.float64) * factor)
    return x[(wide >= info.min) & (wide <= info.max)].astype(INT_NP[dtype])


def _scale_reference(x: np.ndarray, dtype: DataType, factor: float) -> np.ndarray:
    with np.errstate(over="ignore"):
        if dtype in INT_NP:  # float64 product, truncated toward zero
            return np.trunc(x.astype(np.float64) * factor).astype(x.dtype)
        if dtype == DataType.FLOAT64:
            return x * factor
        f = np.float32(factor)  # float32 arithmetic with the factor rounded to float32
        if dtype == DataType.FLOAT32:
            return x * f
        if dtype == DataType.FLOAT16:
            return (x.astype(np.float32) * f).astype(np.float16)
        return _f32_to_bf16(_bf16_to_f32(x) * f)


@pytest.mark.parametrize("factor", FACTORS, ids=lambda f: f"{f:.4g}")
@pytest.mark.parametrize("dtype", list(NP), ids=lambda d: d.name)
def test_scale_matches_horovod_arithmetic(dtype, factor):
    x = _scale_inputs(dtype, factor)
    want = _scale_reference(x, dtype, factor)
    y = x.copy()
    native.scale(y.ctypes.data, y.size, int(dtype), factor)
    differ = np.count_nonzero(y.view(np.uint8) != want.view(np.uint8))
    assert differ == 0, f"scale: {differ} bytes of {y.nbytes} differ"
    # The fused unpack: several buffers, out of place, same arithmetic.
    cuts = sorted({0, min(1, x.size), min(17, x.size), x.size // 3, x.size})
    outs = [np.empty(b - a, x.dtype) for a, b in zip(cuts, cuts[1:])]
    native.copy_scaled_batch([o.ctypes.data for o in outs], [x[a:].ctypes.data for a in cuts[:-1]],
                             [o.size for o in outs], int(dtype), factor)
    differ = np.count_nonzero(np.concatenate(outs).view(np.uint8) != want.view(np.uint8))
    assert differ == 0, f"copy_scaled_batch: {differ} bytes of {y.nbytes} differ"


@pytest.mark.parametrize("dtype", [DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT32])
def test_float32_scaling_differs_from_rounding_once_from_float64(dtype):
    """Guard: the inputs above tell Horovod's float32 arithmetic from a float64 product
    rounded once (what this library did before), so the test above can fail."""
    x = _scale_inputs(dtype, NEAR_1_5)
    ours = _scale_reference(x, dtype, NEAR_1_5)
    with np.errstate(over="ignore"):
        if dtype == DataType.FLOAT32:
            once = (x.astype(np.float64) * NEAR_1_5).astype(np.float32)
        elif dtype == DataType.FLOAT16:
            once = (x.astype(np.float64) * NEAR_1_5).astype(np.float32).astype(np.float16)
        else:
            wide = _bf16_to_f32(x).astype(np.float64) * NEAR_1_5
            once = _f32_to_bf16(wide.astype(np.float32))
    assert np.count_nonzero(ours.view(np.uint8) != once.view(np.uint8)) > 100


def test_scaling_nan_stays_nan_and_factor_one_is_identity():
    for dtype, nan in [(DataType.FLOAT16, 0x7E00), (DataType.BFLOAT16, 0x7FC0)]:
        y = np.array([nan, nan | 0x8000], dtype=np.uint16)
        native.scale(y.ctypes.data, 2, int(dtype), 0.3)
        f32 = y.view(np.float16).astype(np.float32) if dtype == DataType.FLOAT16 \
            else _bf16_to_f32(y)
        assert np.isnan(f32).all()
    big = np.array([(1 << 62) + 1], dtype=np.int64)  # not a float64: a factor of 1 is skipped
    native.scale(big.ctypes.data, 1, int(DataType.INT64), 1.0)
    assert big[0] == (1 << 62) + 1


def test_copy_batch_and_errors():
    srcs = [np.arange(n, dtype=np.float64) for n in (0, 1, 7, 1000)]
    dsts = [np.zeros_like(s) for s in srcs]
    native.copy_batch([d.ctypes.data for d in dsts], [s.ctypes.data for s in srcs],
                      [s.nbytes for s in srcs])
    for d, s in zip(dsts, srcs):
        assert np.array_equal(d, s)
    with pytest.raises(ValueError):
        native.copy_batch([0], [], [])
    with pytest.raises(ValueError):
        native.scale(0, 3, 99, 2.0)


def test_response_fusion_key_and_sizes():
    from aiak_training.runtime.entries import TensorEntry
    r = Response(OpType.ALLREDUCE, ["x"], dtype=int(DataType.FLOAT64), shapes=[[(3, 5)] * 2],
                 reduce_op=int(ReduceOp.SUM), prescale=0.5)
    assert r.nbytes == 3 * 5 * 8
    same = Response(OpType.ALLREDUCE, ["y"], dtype=int(DataType.FLOAT64), shapes=[[(7,)] * 2],
                    reduce_op=int(ReduceOp.SUM), prescale=0.5)
    assert same.fusion_key == r.fusion_key and same.nbytes == 56
    for change in ({"dtype": int(DataType.FLOAT32)}, {"reduce_op": int(ReduceOp.MAX)},
                   {"prescale": 1.0}, {"postscale": 2.0}, {"joined_ranks": (1,)},
                   {"gpu": True}):
        fields = dict(dtype=int(DataType.FLOAT64), shapes=[[(7,)] * 2],
                      reduce_op=int(ReduceOp.SUM), prescale=0.5)
        fields.update(change)
        assert Response(OpType.ALLREDUCE, ["y"], **fields).fusion_key != r.fusion_key, change
    assert Response(OpType.BROADCAST, ["y"], dtype=int(DataType.FLOAT64), shapes=[[(7,)] * 2],
                    reduce_op=int(ReduceOp.SUM), prescale=0.5).fusion_key != r.fusion_key
    e = TensorEntry("x", DataType.INT16, (4, 0, 2), 0)
    assert (e.count, e.nbytes) == (0, 0)
    e = TensorEntry("x", DataType.BFLOAT16, (4, 3), 0)
    assert (e.count, e.nbytes) == (12, 24)
    assert (TensorEntry("s", DataType.FLOAT32, (), 0).count, ) == (1, )


def test_stall_shutdown_below_warning_time_is_ignored(caplog):
    from aiak_training.runtime.engine import stall_times

    def times(check, shutdown, disable=False, deadlock=False):
        return stall_times(Config(stall_check_time_s=check, stall_shutdown_time_s=shutdown,
                                  stall_check_disable=disable, deadlock_shutdown=deadlock))
    with caplog.at_level("WARNING", logger="aiak_training"):
        assert times(5.0, 2.0) == (5.0, 0.0, 0.0)
    assert "will not shutdown" in caplog.text
    assert times(5.0, 7.0) == (5.0, 7.0, 0.0)
    assert times(0.0, 7.0) == (0.0, 7.0, 0.0)
    assert times(5.0, 2.0, disable=True) == (0.0, 2.0, 0.0)
    # The deadlock check runs on the warning time, and only while the stall check does.
    assert times(5.0, 0.0, deadlock=True) == (5.0, 0.0, 5.0)
    assert times(5.0, 0.0, disable=True, deadlock=True) == (0.0, 0.0, 0.0)


def test_deadlock_shutdown_follows_horovod_variables(monkeypatch):
    monkeypatch.delenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", raising=False)
    monkeypatch.delenv("AIAK_DEADLOCK_SHUTDOWN", raising=False)
    assert Config.from_env().deadlock_shutdown is True
    monkeypatch.setenv("AIAK_DEADLOCK_SHUTDOWN", "0")
    assert Config.from_env().deadlock_shutdown is False
    monkeypatch.delenv("AIAK_DEADLOCK_SHUTDOWN")
    # Any explicit shutdown time, 0 ("never") included, keeps Horovod's rule alone ...
    for value in ("0", "120"):
        monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", value)
        assert Config.from_env().deadlock_shutdown is False
    # ... unless AIAK_DEADLOCK_SHUTDOWN asks for both.
    monkeypatch.setenv("AIAK_DEADLOCK_SHUTDOWN", "1")
    assert Config.from_env().deadlock_shutdown is True


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1048576")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2.5")
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "0")
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")
    cfg = Config.from_env()
    assert (cfg.fusion_threshold, cfg.cycle_time_ms, cfg.cache_capacity) == (1048576, 2.5, 0)
    assert cfg.hierarchical_allreduce is True and cfg.allreduce_algo == "auto"
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "0")
    assert Config.from_env().hierarchical_allreduce is False
    monkeypatch.delenv("HOROVOD_HIERARCHICAL_ALLREDUCE")
    assert Config.from_env().hierarchical_allreduce is None
    monkeypatch.setenv("AIAK_ALLREDUCE_ALGO", "ring")
    with pytest.raises(ValueError, match="AIAK_ALLREDUCE_ALGO"):
        Config.from_env()
    monkeypatch.setenv("AIAK_ALLREDUCE_ALGO", "flat")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "fast")
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME"):
        Config.from_env()


def test_compression_fp16_roundtrip():
    import aiak_training.torch as hvd
    t = torch.tensor([1.0, 2.5, -3.25], dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16
    assert torch.equal(hvd.Compression.fp16.decompress(c, ctx), t)
    i = torch.tensor([1, 2])
    c, ctx = hvd.Compression.fp16.compress(i)
    assert c.dtype == torch.int64 and hvd.Compression.fp16.decompress(c, ctx) is c


def test_native_float_repr_matches_python():
    # The coordinator (csrc/engine/controller.cpp) words "Mismatched prescale ... factors"
    # with Python's float repr, the form the rest of the API's messages print.
    rng = np.random.default_rng(0)
    values = [0.0, -0.0, 1.0, 0.5, 2.0, 1 / 3, 0.1, 1e-5, 1e-4, 123456.0, 1e15, 1e16, 1.5e16,
              1e-300, 5e-324, 1.7976931348623157e308, float("inf"), -float("inf"), -2.5,
              9007199254740993.0, 0.30000000000000004, 100.0, 1234567890123456.0]
    values += list(rng.standard_normal(2000) * 10.0 ** rng.integers(-20, 20, 2000))
    for v in values:
        assert native.float_repr(float(v)) == repr(float(v)), v
