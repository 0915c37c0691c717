"""Single-process DGC tests: threshold selection, the exchange's wire format, the warm-up
schedule and the options.  The multi-rank tests are in tests/parallel/test_dgc*.py, launched
by tests/test_dgc_multiprocess.py.

References are computed independently: the expected top-k set by a numpy lexsort on
(-|x|, index), the expected sums by plain Python loops.
"""
import math
import os

import numpy as np
import pytest
import torch

import aiak_training.torch as hvd
from aiak_training.dgc import DGCCompressor, DensitySchedule, PAPER_WARMUP_DENSITIES, select_topk
from aiak_training.dgc import _kernels
from aiak_training.dgc.wire import pack, parse_segments, segment_layout

native = pytest.mark.skipif(not _kernels.native_available(),
                            reason=f"aiak_training.dgc._dgc_cpu not built: {_kernels.IMPORT_ERROR}")


def expected_topk(x: torch.Tensor, k: int) -> list:
    """Top-k of |x| with ties to the smaller index, never zero/NaN, ascending."""
    a = np.abs(x.numpy().astype(np.float64))
    a = np.where(np.isnan(a), 0.0, a)
    order = np.lexsort((np.arange(a.size), -a))  # primary key -|x|, then index
    chosen = [int(i) for i in order[:k] if a[i] > 0]
    return sorted(chosen)


def _cases():
    g = torch.Generator().manual_seed(7)
    n = 1 << 20
    normal = torch.randn(n, generator=g)
    heavy = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(8)  # heavy-tailed
    ties = torch.randint(-3, 4, (1 << 16,), generator=g).float()              # massive ties
    few = torch.zeros(50_000)
    few[[3, 17, 4000, 49_999, 123]] = torch.tensor([1.0, -2.0, 0.5, -0.25, 2.0])
    with_nan = torch.randn(40_000, generator=g)
    with_nan[::7] = float("nan")
    big_nan = torch.randn(1 << 20, generator=g)
    big_nan[::3] = float("nan")  # NaNs in the sample, too
    big_nan[5::11] = float("inf")
    odd = torch.randn(100_003, generator=g)                                  # ragged tail
    return {
        "normal_0.001": (normal, math.ceil(0.001 * n)),
        "normal_0.004": (normal, math.ceil(0.004 * n)),
        "normal_0.0156": (normal, math.ceil(0.015625 * n)),
        "normal_0.25": (normal, n // 4),
        "heavy_0.001": (heavy, math.ceil(0.001 * n)),
        "ties_k100": (ties, 100),
        "few_nonzeros": (few, 50),
        "all_zero": (torch.zeros(70_000), 70),
        "nan": (with_nan, 40),
        "nan_inf_sampled": (big_nan, 40_000),
        "ragged": (odd, 101),
        "tiny": (torch.tensor([0.5, -3.0, 3.0, 0.0, 1.0]), 2),
        "k_ge_n": (torch.tensor([1.0, 0.0, -2.0]), 10),
        "float64": (torch.randn(300_000, generator=g, dtype=torch.float64), 300),
    }


CASES = _cases()
_EXPECTED = {}


def expected_case(name: str) -> list:
    """expected_topk of a named case, computed once (the lexsort of 1M elements is slow)."""
    if name not in _EXPECTED:
        _EXPECTED[name] = expected_topk(*CASES[name])
    return _EXPECTED[name]


@native
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("exact", [False, True])
def test_native_selection_is_the_exact_topk(name, exact):
    x, k = CASES[name]
    idx, path = select_topk(x, k, exact=exact, seed=3)
    assert idx.dtype == torch.int32
    assert idx.tolist() == expected_case(name)
    if exact:
        assert path == 0


@pytest.mark.parametrize("name", ["normal_0.001", "ties_k100", "few_nonzeros", "nan", "tiny",
                                  "float64", "all_zero"])
def test_torch_fallback_selection_is_the_exact_topk(name):
    x, k = CASES[name]
    idx, path = select_topk(x, k, use_native=False)
    assert path == _kernels.PATH_TORCH
    assert idx.tolist() == expected_case(name)


@native
def test_sampled_path_is_used_and_cheap():
    x, k = CASES["normal_0.001"]
    for seed in range(5):  # the result never depends on the sample
        idx, path = select_topk(x, k, seed=seed)
        assert 1 <= path <= 3, path
        assert idx.tolist() == expected_case("normal_0.001")
    # Candidates the refinement looked at: a few k, not n.
    out = torch.empty(k, dtype=torch.int32)  # kept alive across the call
    count, path, candidates = _kernels.ext.select_topk(
        x.data_ptr(), x.numel(), _kernels.DTYPE_CODES[x.dtype], k, out.data_ptr(), 0.01, 1, False)
    assert count == k and 1 <= path <= 3 and k <= candidates <= 16 * k


@native
def test_ties_overflowing_the_candidate_buffer_fall_back_to_exact():
    # 32768 equal values: the sampled threshold equals the tie value, far more than 4x the
    # expected candidates pass it, so the kernel must fall back to the exact path.
    x = torch.ones(1 << 20)
    x[: 1 << 15] = 2.0
    x[5] = 3.0
    idx, path = select_topk(x, 1000, seed=0)
    assert path == _kernels.PATH_FALLBACK
    assert idx.tolist() == expected_topk(x, 1000)


def _supported_isas():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return ["scalar"] + [i for i, f in (("avx2", " avx2"), ("avx512", " avx512f")) if f in flags]


@native
@pytest.mark.parametrize("isa", _supported_isas())
def test_every_scan_isa_gives_the_same_indices(isa):
    """The vector scans (AVX2, AVX-512) and the portable one find the same candidates,
    including ragged tails and the candidate-cap overflow (heavy ties)."""
    previous = _kernels.ext.set_isa(isa)
    try:
        assert _kernels.isa() == isa
        for name in ("normal_0.001", "heavy_0.001", "ragged", "ties_k100", "nan"):
            x, k = CASES[name]
            assert select_topk(x, k)[0].tolist() == expected_case(name), name
        ties = torch.ones(1 << 20)
        ties[: 1 << 15] = 2.0
        assert select_topk(ties, 1000)[1] == _kernels.PATH_FALLBACK
    finally:
        _kernels.ext.set_isa(previous)
    with pytest.raises(RuntimeError):
        _kernels.ext.set_isa("sse9")


def test_select_topk_rejects_bad_input():
    with pytest.raises(ValueError):
        select_topk(torch.zeros(4, 4), 2)
    with pytest.raises(ValueError):
        select_topk(torch.zeros(8, dtype=torch.float16), 2)


# ---- wire format ---------------------------------------------------------------------------
def _rank_pairs(rank: int):
    """Three tensors: overlapping indices, unequal counts, one rank with nothing."""
    numels = [1000, 64, 5000]
    wire = [torch.float32, torch.float16, torch.float64]
    g = torch.Generator().manual_seed(100 + rank)
    counts = [17 * (rank + 1), 0 if rank == 1 else 5 + rank, 3]
    indices, values = [], []
    for n, c, dtype in zip(numels, counts, wire):
        idx = torch.sort(torch.randperm(n, generator=g)[:c]).values.to(torch.int32)
        if c:
            idx[0] = 0  # index 0 selected by every rank that sends anything: duplicates
        vals = torch.randint(-8, 9, (c,), generator=g).to(dtype)
        indices.append(idx)
        values.append(vals)
    return numels, wire, indices, values


@pytest.mark.parametrize("use_native", [
    pytest.param(True, marks=native), False])
def test_scatter_add_of_gathered_segments_equals_dense_sum(use_native):
    nranks = 3
    segments = []
    expected = None
    for r in range(nranks):
        numels, wire, indices, values = _rank_pairs(r)
        segments.append(pack(indices, values))
        if expected is None:
            expected = [[0.0] * n for n in numels]
        for t, (idx, vals) in enumerate(zip(indices, values)):
            for i, v in zip(idx.tolist(), vals.tolist()):
                expected[t][i] += v
    buf = torch.cat(segments)  # what allgather returns
    outs = [torch.zeros(n, dtype=torch.float32 if t < 2 else torch.float64)
            for t, n in enumerate(numels)]
    pairs = _kernels.scatter_add_segments(buf, nranks, outs, wire, use_native=use_native)
    assert pairs == sum(int(i.numel()) for r in range(nranks) for i in _rank_pairs(r)[2])
    for out, exp in zip(outs, expected):
        assert out.tolist() == exp
    for out in outs:  # scaled: halving small integers is exact in every dtype
        out.zero_()
    _kernels.scatter_add_segments(buf, nranks, outs, wire, scale=0.5, use_native=use_native)
    for out, exp in zip(outs, expected):
        assert out.tolist() == [0.5 * e for e in exp]


def test_segment_layout_and_round_trip():
    numels, wire, indices, values = _rank_pairs(0)
    buf = pack(indices, values)
    counts = [int(i.numel()) for i in indices]
    offsets, total = segment_layout(counts, wire)
    assert buf.numel() == total and total % 8 == 0
    # header + indices, then f32 block, f16 block (2-aligned), f64 block (8-aligned)
    assert offsets[0] == 4 * 3 + 4 * sum(counts)
    assert offsets[2] % 8 == 0
    (segment,) = list(parse_segments(buf, 1, numels, wire))
    for (idx, vals), i0, v0 in zip(segment, indices, values):
        assert torch.equal(idx, i0) and torch.equal(vals, v0)


@pytest.mark.parametrize("use_native", [
    pytest.param(True, marks=native), False])
def test_malformed_buffers_raise(use_native):
    numels, wire, indices, values = _rank_pairs(0)
    good = pack(indices, values)
    outs = [torch.zeros(n, dtype=torch.float64) for n in numels]
    with pytest.raises(RuntimeError, match="left after|past the buffer|truncated"):
        _kernels.scatter_add_segments(good[:-8], 1, outs, wire, use_native=use_native)
    with pytest.raises(RuntimeError, match="left after"):
        _kernels.scatter_add_segments(torch.cat([good, good]), 1, outs, wire,
                                      use_native=use_native)
    with pytest.raises(RuntimeError, match="out of range"):
        _kernels.scatter_add_segments(good, 1, [torch.zeros(500, dtype=torch.float64)] + outs[1:],
                                      wire, use_native=use_native)


# ---- warm-up schedule ----------------------------------------------------------------------
def test_paper_schedule_by_steps_is_exact():
    s = DensitySchedule(0.001, warmup_steps=8)
    got = [s(step) for step in range(12)]
    assert got == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.004, 0.004,
                   0.001, 0.001, 0.001, 0.001]
    assert PAPER_WARMUP_DENSITIES == (0.25, 0.0625, 0.015625, 0.004)
    # sparsities 75%, 93.75%, 98.4375%, 99.6%, then 99.9%
    assert [round(100 * (1 - d), 4) for d in PAPER_WARMUP_DENSITIES + (0.001,)] == \
        [75.0, 93.75, 98.4375, 99.6, 99.9]


def test_schedule_by_epochs_with_steps_per_epoch():
    s = DensitySchedule(0.001, warmup_epochs=4, steps_per_epoch=3)
    got = [s(step) for step in range(14)]
    assert got == [0.25] * 3 + [0.0625] * 3 + [0.015625] * 3 + [0.004] * 3 + [0.001] * 2


def test_schedule_uneven_split_and_custom_densities():
    s = DensitySchedule(0.01, warmup_densities=(0.5, 0.1, 0.05), warmup_steps=7)
    # stage = floor(step * 3 / 7)
    assert [s(step) for step in range(9)] == [0.5, 0.5, 0.5, 0.1, 0.1, 0.05, 0.05, 0.01, 0.01]


def test_schedule_by_reported_epoch():
    s = DensitySchedule(0.001, warmup_epochs=2)
    assert s.needs_epoch
    assert [s(0, e) for e in (0, 0.49, 0.5, 1.0, 1.5, 1.99, 2.0, 7)] == \
        [0.25, 0.25, 0.0625, 0.015625, 0.004, 0.004, 0.001, 0.001]


def test_no_warmup():
    for s in (DensitySchedule(0.001, warmup_densities=()), DensitySchedule(0.001, warmup_steps=0),
              DensitySchedule(0.001, warmup_epochs=0)):
        assert not s.needs_epoch and s(0) == 0.001 and s(5, 0.0) == 0.001


@pytest.mark.parametrize("kwargs", [dict(density=0), dict(density=1.5),
                                    dict(density=0.1, warmup_densities=(0.0,)),
                                    dict(density=0.1, warmup_steps=-1),
                                    dict(density=0.1, warmup_epochs=1, steps_per_epoch=0)])
def test_schedule_validation(kwargs):
    with pytest.raises(ValueError):
        DensitySchedule(**kwargs)


# ---- options ---------------------------------------------------------------------------------
def test_compression_dgc_is_the_compressor_class_and_a_factory():
    assert hvd.Compression.dgc is DGCCompressor
    c = hvd.Compression.dgc(density=0.01, steps_per_epoch=10)
    assert callable(c.make_distributed_optimizer)
    assert callable(hvd.Compression.dgc.make_distributed_optimizer)  # defaults, on the class
    assert c.schedule()(39) == 0.004 and c.schedule()(40) == 0.01
    with pytest.raises(TypeError):
        c.compress(torch.zeros(3))


def test_what_goes_dense():
    c = DGCCompressor(min_numel=100)
    assert c.compresses(torch.zeros(10, 10))
    assert not c.compresses(torch.zeros(1000))                      # 1-D: bias / norm
    assert not c.compresses(torch.zeros(9, 11))                     # below min_numel
    assert not c.compresses(torch.zeros(10, 10, dtype=torch.float16))
    assert c.compresses(torch.zeros(10, 10, dtype=torch.float64))


@pytest.mark.parametrize("kwargs", [dict(clip_norm=0), dict(min_numel=-1), dict(sample_ratio=0),
                                    dict(density=2.0)])
def test_option_validation(kwargs):
    with pytest.raises(ValueError):
        DGCCompressor(**kwargs)


# ---- momentum correction kernel ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m,damp,wd,nesterov,first", [
    (0.9, 0.0, 0.0, False, False), (0.9, 0.0, 1e-2, True, False), (0.8, 0.3, 1e-3, False, False),
    (0.9, 0.0, 1e-3, False, True), (0.0, 0.0, 1e-3, False, False)])
@pytest.mark.parametrize("use_native", [pytest.param(True, marks=native), False])
def test_compensate_matches_the_formulas(dtype, m, damp, wd, nesterov, first, use_native):
    g0 = torch.Generator().manual_seed(3)
    n = 10_007
    g, w, u0, v0 = (torch.randn(n, generator=g0, dtype=dtype) for _ in range(4))
    u, v = u0.clone(), v0.clone()
    _kernels.compensate(g, w, u if m else None, v, m, damp, wd, nesterov, first,
                        use_native=use_native)
    # float64 reference from the documented formulas
    G, W, U, V = (t.double().numpy() for t in (g, w, u0, v0))
    Gp = G + wd * W
    if m:
        U = Gp if first else m * U + (1 - damp) * Gp
        V = V + Gp + m * U if nesterov else V + U
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        assert np.allclose(u.double().numpy(), U, rtol=0, atol=tol)
    else:
        V = V + Gp
        assert torch.equal(u, u0)
    tol = 1e-5 if dtype == torch.float32 else 1e-13
    assert np.allclose(v.double().numpy(), V, rtol=0, atol=tol)


@native
@pytest.mark.parametrize("case", ["sampled", "ties", "small", "no_momentum", "float64", "exact"])
def test_fused_compensate_select_equals_update_then_topk(case):
    g0 = torch.Generator().manual_seed(9)
    dtype = torch.float64 if case == "float64" else torch.float32
    n = 5000 if case == "small" else 1 << 20
    g, w, u0, v0 = (torch.randn(n, generator=g0, dtype=dtype) for _ in range(4))
    if case == "ties":  # updated v full of equal values: the fused scan overflows its cap
        g, w, u0 = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        v0 = torch.ones(n)
        v0[: 1 << 15] = 2.0
    m = 0.0 if case == "no_momentum" else 0.9
    k = 1049 if case != "small" else 5
    u, v = u0.clone(), v0.clone()
    idx, path = _kernels.compensate_select(g, w, u if m else None, v, m, 0.0, 1e-3, True, False,
                                           k, exact=case == "exact", seed=4)
    u_ref, v_ref = u0.clone(), v0.clone()
    _kernels.compensate(g, w, u_ref if m else None, v_ref, m, 0.0, 1e-3, True, False)
    tol = 1e-5 if dtype == torch.float32 else 1e-13
    assert torch.allclose(v, v_ref, rtol=0, atol=tol) and torch.allclose(u, u_ref, rtol=0, atol=tol)
    assert idx.tolist() == expected_topk(v.clone(), k)
    if case in ("sampled", "float64", "no_momentum"):
        assert path == 1  # one fused pass
    if case == "ties":
        assert path in (0, 2, _kernels.PATH_FALLBACK)
