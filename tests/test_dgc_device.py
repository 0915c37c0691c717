"""DGC's device path (aiak_training/dgc/device_select.py and the slot-filled exchange), run on
CPU tensors: the code that runs on CUDA gradients, checked here against the independent
top-k reference of tests/test_dgc.py, against the compiled CPU kernels bit for bit, and for
host synchronisations (none per tensor, one per step)."""
import contextlib
import math

import numpy as np
import pytest
import torch

from aiak_training.dgc import DGCCompressor, _kernels, device_select
from aiak_training.dgc.compressor import check_parameter
from aiak_training.dgc.exchange import add_slots
from aiak_training.dgc.wire import PAD, pack_slots, parse_segments, slot_views
from test_dgc import CASES, expected_case, native

SAMPLED = ["normal_0.001", "normal_0.004", "heavy_0.001", "nan_inf_sampled", "ragged",
           "float64"]


@contextlib.contextmanager
def count_host_reads():
    """Count the calls that read a tensor's data on the host (each one waits for a GPU)."""
    calls = []
    names = ["item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__",
             "__index__"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            calls.append(name)
            return fn(self, *args, **kwargs)
        return counted
    for n, fn in saved.items():
        setattr(torch.Tensor, n, wrap(n, fn))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def select(x, k, **kwargs):
    slots, counts, paths = device_select.resolve(device_select.start([x], [k], **kwargs))
    return slots[0], counts[0], paths[0]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("exact", [False, True])
def test_device_selection_is_the_exact_topk(name, exact):
    x, k = CASES[name]
    slots, count, path = select(x, k, exact=exact, seed=3)
    k_slots = min(max(k, 1), x.numel())
    assert slots.shape == (k_slots,) and slots.dtype == torch.int64
    assert slots[:count].tolist() == expected_case(name)
    assert bool((slots[count:] == PAD).all())
    if exact:
        assert path == device_select.PATH_EXACT
    elif name in SAMPLED:
        assert path == device_select.PATH_SAMPLED  # the sample sufficed


@pytest.mark.parametrize("name", ["ties_k100", "all_zero"])
def test_degenerate_samples_fall_back_to_exact(name):
    x, k = CASES[name]
    big = x.repeat(1 << 4) if x.numel() < device_select.MIN_SAMPLED_N * 4 else x
    slots, count, path = select(big, k, seed=1)
    assert path == device_select.PATH_FALLBACK
    from test_dgc import expected_topk
    assert slots[:count].tolist() == expected_topk(big, k)


@native
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 5])
def test_device_and_compiled_selections_agree(name, seed):
    x, k = CASES[name]
    native_idx, _ = _kernels.select_topk(x, k, seed=seed)
    slots, count, _ = select(x, k, seed=seed)
    assert slots[:count].tolist() == native_idx.tolist()


def test_the_result_does_not_depend_on_the_seed():
    x, k = CASES["heavy_0.001"]
    runs = [select(x, k, seed=s) for s in range(4)]
    assert all(torch.equal(r[0], runs[0][0]) for r in runs)
    assert all(r[2] == device_select.PATH_SAMPLED for r in runs)


def test_a_batch_selects_each_tensor_as_alone():
    """Tensors of different sizes, densities and dtypes, sampled and exact, selected in one
    call: each gets its own exact top-k (the batch shares sorts and scans, not results)."""
    names = ["normal_0.001", "ties_k100", "heavy_0.001", "tiny", "float64", "nan_inf_sampled",
             "ragged", "few_nonzeros", "normal_0.004"]
    xs, ks = [CASES[n][0] for n in names], [CASES[n][1] for n in names]
    slots, counts, paths = device_select.resolve(device_select.start(xs, ks, seed=9))
    for n, s, c in zip(names, slots, counts):
        assert s[:c].tolist() == expected_case(n), n
    assert paths.count(device_select.PATH_SAMPLED) >= 5, paths
    # The same tensor twice in one batch: the same answer twice.
    slots, counts, _ = device_select.resolve(device_select.start(xs[:1] * 2, ks[:1] * 2))
    assert torch.equal(slots[0], slots[1]) and counts == [ks[0], ks[0]]


@pytest.mark.parametrize("size", [1, 7, 50, 5000])
def test_compact_scatter_equals_nonzero_static(size):
    g = torch.Generator().manual_seed(size)
    for density in (0.0, 0.01, 0.5, 1.0):
        mask = torch.rand(3000, generator=g) < density
        expected = torch.nonzero_static(mask, size=size, fill_value=-1).view(-1)
        assert torch.equal(device_select.compact_scatter(mask, size), expected)
        assert torch.equal(device_select.compact(mask, size), expected)


def test_selection_reads_nothing_on_the_host_until_resolve(monkeypatch):
    # compact() takes nonzero_static on the CPU; count the GPU branch's ops instead.
    monkeypatch.setattr(device_select, "compact", device_select.compact_scatter)
    names = ("normal_0.001", "ties_k100", "float64", "tiny", "heavy_0.001")
    xs = [CASES[n][0] for n in names]
    ks = [CASES[n][1] for n in names]
    device_select.start(xs, ks, seed=2)  # the layouts are made (and cached) once
    with count_host_reads() as calls:
        pending = device_select.start(xs, ks, seed=2)
    assert calls == []
    with count_host_reads() as calls:
        slots, counts, paths = device_select.resolve(pending)
    assert calls == ["tolist"]  # one read for every tensor, and the fallback's exact path
    assert device_select.PATH_FALLBACK in paths and device_select.PATH_SAMPLED in paths
    for s, c, n in zip(slots, counts, names):
        assert s[:c].tolist() == expected_case(n)


# ---- the slot-filled exchange ---------------------------------------------------------------
NUMELS = [1000, 64, 5000]
WIRE = [torch.float32, torch.float16, torch.float64]
SLOTS = [40, 9, 3]


def _rank_slots(rank, wire=WIRE):
    """Each tensor's pairs in its slots: some empty slots (rank 1 sends nothing for tensor
    1), index 0 sent by every rank (duplicates across ranks), tiny values whose halves
    round to -0.0 in float32."""
    g = torch.Generator().manual_seed(300 + rank)
    counts = [17 * (rank + 1) % 41, 0 if rank == 1 else 5 + rank, 3]
    indices, values = [], []
    for n, k, c, dtype in zip(NUMELS, SLOTS, counts, wire):
        idx = torch.full((k,), PAD, dtype=torch.int32)
        vals = torch.zeros(k, dtype=dtype)
        if c:
            chosen = torch.sort(torch.randperm(n, generator=g)[:c]).values
            chosen[0] = 0
            idx[:c] = torch.sort(chosen).values.to(torch.int32)
            vals[:c] = torch.randint(-8, 9, (c,), generator=g).to(dtype)
            if dtype == torch.float32:
                vals[0] = -1.4e-45  # the smallest subnormal: times 0.5 it is -0.0
        indices.append(idx)
        values.append(vals)
    return indices, values


def _gathered(nranks, wire=WIRE):
    header = torch.tensor(SLOTS, dtype=torch.int32)
    return torch.cat([pack_slots(*_rank_slots(r, wire), header) for r in range(nranks)])


# Mixed dtypes take the per-tensor path; one dtype everywhere the flat one.
LAYOUTS = {"mixed": (WIRE, [torch.float32, torch.float32, torch.float64]),
           "uniform": ([torch.float32] * 3, [torch.float32] * 3),
           "uniform_fp16": ([torch.float16] * 3, [torch.float64] * 3)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_slot_exchange_equals_dense_sum(scale, layout):
    nranks = 3
    wire, out_dtypes = LAYOUTS[layout]
    buf = _gathered(nranks, wire)
    outs = [torch.zeros(n, dtype=d) for n, d in zip(NUMELS, out_dtypes)]
    add_slots(buf, nranks, outs, SLOTS, wire, scale=scale)
    for t, out in enumerate(outs):
        expected = np.zeros(NUMELS[t], dtype=np.float32 if out.dtype == torch.float32
                            else np.float64)
        for r in range(nranks):  # rank order, as the exchange promises
            idx, vals = _rank_slots(r, wire)
            for i, v in zip(idx[t].tolist(), vals[t].tolist()):
                if i != PAD:
                    expected[i] += expected.dtype.type(v) * expected.dtype.type(scale)
        assert out.numpy().tobytes() == expected.tobytes()  # bits, signs of zeros included


@native
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_slot_exchange_gives_the_compiled_parser_bits(scale, layout):
    nranks = 3
    wire, out_dtypes = LAYOUTS[layout]
    buf = _gathered(nranks, wire)
    outs = [[torch.zeros(n, dtype=d) for n, d in zip(NUMELS, out_dtypes)] for _ in range(2)]
    add_slots(buf, nranks, outs[0], SLOTS, wire, scale=scale)
    _kernels.scatter_add_segments(buf, nranks, outs[1], wire, scale=scale, use_native=True)
    for a, b in zip(*outs):
        assert a.numpy().tobytes() == b.numpy().tobytes()
    # The torch parser of variable segments skips the empty slots too.
    for r, segment in enumerate(parse_segments(buf, nranks, NUMELS, wire)):
        idx, _ = _rank_slots(r, wire)
        for (got, _), want in zip(segment, idx):
            assert got.tolist() == [i for i in want.tolist() if i != PAD]


def test_slot_views_check_the_length():
    buf = _gathered(2)
    views = slot_views(buf, 2, SLOTS, WIRE)
    assert [tuple(i.shape) for i, _ in views] == [(2, k) for k in SLOTS]
    with pytest.raises(RuntimeError, match="ranks disagree"):
        slot_views(buf[:-8], 2, SLOTS, WIRE)
    with count_host_reads() as calls:
        add_slots(buf, 2, [torch.zeros(n, dtype=torch.float64) for n in NUMELS], SLOTS, WIRE)
    assert calls == []
    wire = [torch.float32] * 3
    flat = _gathered(2, wire)
    add_slots(flat, 2, [torch.zeros(n) for n in NUMELS], SLOTS, wire)  # makes the offsets
    with count_host_reads() as calls:
        add_slots(flat, 2, [torch.zeros(n) for n in NUMELS], SLOTS, wire)
    assert calls == []


# ---- bad input -------------------------------------------------------------------------------
def test_half_precision_matrices_are_refused_naming_the_dtype():
    c = DGCCompressor(min_numel=100)
    for dtype in (torch.float16, torch.bfloat16):
        with pytest.raises(ValueError, match=str(dtype).replace(".", r"\.") + ".*float32"):
            c.check_parameter(torch.zeros(10, 10, dtype=dtype), "fc.weight", None)
        c.check_parameter(torch.zeros(10, dtype=dtype), "fc.bias", None)    # 1-D: dense
        c.check_parameter(torch.zeros(9, 11, dtype=dtype), "small", None)   # below min_numel


def test_half_precision_model_is_refused_by_the_optimizer():
    import aiak_training.torch as hvd
    hvd.init()
    model = torch.nn.Linear(64, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="'weight' is torch.bfloat16"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=model.named_parameters(),
                                 compression=hvd.Compression.dgc(min_numel=16))


def test_parameter_on_another_gpu_is_refused():
    c = DGCCompressor()
    with pytest.raises(ValueError, match="on cuda:1, but this rank uses cuda:0"):
        check_parameter(c, torch.device("cuda", 1), torch.float32, True, "w", 0)
    check_parameter(c, torch.device("cuda", 0), torch.float32, True, "w", 0)
    check_parameter(c, torch.device("cuda"), torch.float32, True, "w", 0)  # current device
    assert c.compresses(torch.zeros(64, 64, device="meta"))  # any device is compressed


def test_compensate_torch_ops_give_the_kernel_bits():
    if not _kernels.native_available():
        pytest.skip("compiled kernels not built")
    g0 = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.float64):
        for m, first, nesterov in ((0.9, False, False), (0.9, True, True), (0.0, False, False)):
            g, w, u0, v0 = (torch.randn(10_007, generator=g0, dtype=dtype) for _ in range(4))
            out = []
            for use_native in (True, False):
                u, v = u0.clone(), v0.clone()
                _kernels.compensate(g, w, u if m else None, v, m, 0.1, 1e-3, nesterov, first,
                                    use_native=use_native)
                out.append((u, v))
            assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_sampled_sizes_follow_the_kernel_constants():
    n, k = 1 << 20, math.ceil(0.001 * (1 << 20))
    blocks, spacing = device_select.sample_blocks(n, k, 0.01)
    want = max(math.ceil(n * 0.01), math.ceil(32 / (2.0 * k / n)))
    assert blocks == math.ceil(want / 8) and spacing * blocks <= n
    assert device_select.sample_blocks(1000, 5, 0.01) is None          # small: exact
    assert device_select.sample_blocks(1 << 20, 1 << 17, 0.01) is None  # dense: exact


def test_compressed_parameters_on_two_devices_are_refused():
    import aiak_training.torch as hvd
    hvd.init()
    a = torch.nn.Parameter(torch.zeros(64, 64))
    b = torch.nn.Parameter(torch.zeros(64, 64, device="meta"))
    with pytest.raises(ValueError, match="on cpu and meta"):
        hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=0.1),
                                 named_parameters=[("a", a), ("b", b)],
                                 compression=hvd.Compression.dgc(min_numel=16))
