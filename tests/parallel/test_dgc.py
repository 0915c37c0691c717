"""DGC per-rank tests (run at 1, 2 and 4 ranks by tests/test_dgc_multiprocess.py).

Every rank can rebuild every rank's data, so references are computed locally and
independently: dense sums by Python loops, training references by a single-process
full-batch torch.optim run, DGC's residual bookkeeping by re-deriving the velocity.
"""
import copy
import io
import math

import pytest
import torch

import aiak_training.torch as hvd
from aiak_training.dgc import sparse_allgather_async

N_IN, N_HID, N_OUT = 6, 8, 3


@pytest.fixture
def float64():
    """Exact comparisons: train in float64 (restored afterwards for other tests)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make_model(seed=0, sizes=(N_IN, N_HID, N_OUT)):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.Tanh(),
                               torch.nn.Linear(sizes[1], sizes[2]))


def batches(step, micro=0, per_rank=4, sizes=(N_IN, N_HID, N_OUT)):
    """Every rank's shard of one (micro)batch; identical on every rank."""
    g = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    x = torch.randn(hvd.size() * per_rank, sizes[0], generator=g)
    y = torch.randn(hvd.size() * per_rank, sizes[2], generator=g)
    return x, y


def shard(t, rank=None):
    n = t.shape[0] // hvd.size()
    r = hvd.rank() if rank is None else rank
    return t[r * n:(r + 1) * n]


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def exact_dgc(**kwargs):
    """DGC that must reproduce momentum SGD: density 1, no masking, no warm-up, all 2-D
    weights compressed."""
    opts = dict(density=1.0, warmup_densities=(), momentum_masking=False, min_numel=0)
    opts.update(kwargs)
    return hvd.Compression.dgc(**opts)


def train_reference(make_opt, steps, passes=1):
    model = make_model()
    opt = make_opt(model.parameters())
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, y = batches(step, micro)
            loss_fn(model, x, y).backward()
        opt.step()
    return model


def train_dgc(make_opt, steps, compression, passes=1, op=hvd.Average):
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, backward_passes_per_step=passes, op=op)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, y = batches(step, micro)
            loss_fn(model, shard(x), shard(y)).backward()
        opt.step()
    return model, opt


def max_diff(a, b):
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def assert_ranks_identical(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    assert torch.equal(gathered, flat.unsqueeze(0).expand_as(gathered)), \
        (gathered - flat).abs().max()


# ---- the sparse exchange ---------------------------------------------------------------------
NUMELS = [1000, 300, 50, 20]
WIRE = [torch.float32, torch.float16, torch.float64, torch.float32]
OUT = [torch.float32, torch.float32, torch.float64, torch.float64]


def rank_pairs(rank):
    """Overlapping indices, unequal sizes per rank, rank 1 sends nothing for tensor 1, every
    rank sends every index of tensor 2, nobody sends anything for tensor 3.  Small integer
    values, so every sum is exact in every dtype."""
    g = torch.Generator().manual_seed(500 + rank)
    counts = [10 * (rank + 1), 0 if rank == 1 else 7 + rank, 50, 0]
    indices, values = [], []
    for n, c, dtype in zip(NUMELS, counts, WIRE):
        idx = torch.randperm(n, generator=g)[:c]
        if 0 < c < n:
            idx[:2] = torch.tensor([0, 1])  # shared by every rank that sends
            idx = torch.unique(idx)
        idx = torch.sort(idx).values.to(torch.int32)
        indices.append(idx)
        values.append(torch.randint(-8, 9, (idx.numel(),), generator=g).to(dtype))
    return indices, values


@pytest.mark.parametrize("use_native", [True, False])
def test_sparse_exchange_equals_dense_sum(use_native):
    from aiak_training.dgc import native_available
    if use_native and not native_available():
        pytest.skip("native kernels not built")
    indices, values = rank_pairs(hvd.rank())
    pending = sparse_allgather_async(indices, values, name=f"exchange.{use_native}")
    outs = [torch.full((n,), 0.0, dtype=d) for n, d in zip(NUMELS, OUT)]
    pairs = pending.finish(outs, use_native=use_native)
    expected = [[0.0] * n for n in NUMELS]
    total = 0
    for r in range(hvd.size()):
        for t, (idx, vals) in enumerate(zip(*rank_pairs(r))):
            total += idx.numel()
            for i, v in zip(idx.tolist(), vals.tolist()):
                expected[t][i] += v
    assert pairs == total
    for out, exp in zip(outs, expected):
        assert out.tolist() == exp
    assert pending.sent_bytes == segment_bytes(hvd.rank())
    assert pending.received_bytes == sum(segment_bytes(r) for r in range(hvd.size()))


def segment_bytes(rank):
    """Wire bytes of rank_pairs(rank), from the documented layout (exchange.py)."""
    align = lambda v, a: (v + a - 1) // a * a  # noqa: E731
    c = [i.numel() for i in rank_pairs(rank)[0]]
    off = 4 * 4 + 4 * sum(c) + 4 * c[0]     # header, indices, float32 values
    off = align(off, 2) + 2 * c[1]          # float16 values
    off = align(off, 8) + 8 * c[2]          # float64 values
    return align(off, 8)                    # tensor 3 sends nothing; pad to 8


def test_sparse_exchange_when_nobody_sends_anything():
    indices = [torch.empty(0, dtype=torch.int32)] * 2
    values = [torch.empty(0), torch.empty(0, dtype=torch.float16)]
    pending = sparse_allgather_async(indices, values, name="exchange.empty")
    outs = [torch.ones(5), torch.ones(7)]
    for o in outs:
        o.zero_()
    assert pending.finish(outs) == 0
    assert all(o.abs().sum() == 0 for o in outs)
    assert pending.sent_bytes == 8 and pending.received_bytes == 8 * hvd.size()


# ---- reductions to momentum SGD --------------------------------------------------------------
SGD_CONFIGS = {
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                              weight_decay=1e-3),
    "dampening_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3,
                                               weight_decay=1e-2),
    "plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
}


@pytest.mark.parametrize("name", list(SGD_CONFIGS))
def test_density_one_without_masking_is_momentum_sgd(float64, name):
    make_opt = SGD_CONFIGS[name]
    model, opt = train_dgc(make_opt, steps=6, compression=exact_dgc())
    reference = train_reference(make_opt, steps=6)
    assert max_diff(model, reference) < 1e-12
    assert isinstance(opt, torch.optim.SGD)
    stats = opt.dgc_stats()
    assert stats["compressed_elements"] == N_IN * N_HID + N_HID * N_OUT  # the weights
    assert stats["selected"] == stats["compressed_elements"]
    # The user's hyper-parameters are back after step(); DGC kept its own state.
    ref_group = make_opt([torch.zeros(1, requires_grad=True)]).param_groups[0]
    for key in ("momentum", "dampening", "nesterov", "weight_decay"):
        assert opt.param_groups[0][key] == ref_group[key]
    weight, bias = model[0].weight, model[0].bias
    assert "dgc_residual" in opt.dgc_state(weight) and "momentum_buffer" not in opt.state[weight]
    if ref_group["momentum"]:
        assert "dgc_velocity" in opt.dgc_state(weight) and "momentum_buffer" in opt.state[bias]
        saved = opt.state_dict()["state"]
        assert set(saved[0]) == {"dgc_residual", "dgc_velocity"}  # 0.weight
        assert set(saved[1]) == {"momentum_buffer"}                # 0.bias


def test_fused_sgd_momentum_is_taken_over_too(float64):
    import aiak_training.fused_optim as fused
    model, opt = train_dgc(lambda ps: fused.FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                     weight_decay=1e-3),
                           steps=6, compression=exact_dgc())
    assert isinstance(opt, fused.FusedSGD)
    assert max_diff(model, train_reference(SGD_CONFIGS["nesterov_wd"], steps=6)) < 1e-12


def test_momentum_masking_at_density_one_is_not_momentum_sgd(float64):
    """The comparison above can fail: with masking, every sent coordinate loses its
    velocity, so DGC at density 1 becomes SGD without momentum on the compressed tensors."""
    make_opt = SGD_CONFIGS["momentum"]
    model, _ = train_dgc(make_opt, steps=6, compression=exact_dgc(momentum_masking=True))
    assert max_diff(model, train_reference(make_opt, steps=6)) > 1e-4


def test_backward_passes_per_step(float64):
    make_opt = SGD_CONFIGS["nesterov_wd"]
    model, _ = train_dgc(make_opt, steps=4, compression=exact_dgc(), passes=2)
    assert max_diff(model, train_reference(make_opt, steps=4, passes=2)) < 1e-12


def test_sum_op_matches_dense_sum(float64):
    make_opt = SGD_CONFIGS["momentum"]
    model, _ = train_dgc(make_opt, steps=3, compression=exact_dgc(), op=hvd.Sum)
    dense, _ = train_dgc(make_opt, steps=3, compression=hvd.Compression.none, op=hvd.Sum)
    assert max_diff(model, dense) < 1e-12


# ---- residual bookkeeping --------------------------------------------------------------------
BIG = (32, 64, 4)  # weights of 2048 and 256 elements


@pytest.mark.parametrize("masking,fp16,nesterov", [(True, False, False), (False, False, False),
                                                   (True, True, False), (True, False, True)])
def test_sent_plus_residual_equals_accumulated_velocity(float64, masking, fp16, nesterov):
    m, wd, density = 0.9, 1e-3, 0.01
    model = make_model(1, BIG)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=m, nesterov=nesterov,
                        weight_decay=wd),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.dgc(density=density, warmup_densities=(), min_numel=0,
                                        momentum_masking=masking, fp16_values=fp16))
    weights = [model[0].weight, model[2].weight]
    u = [None, None]
    accumulated = [torch.zeros(w.numel()) for w in weights]
    sent = [torch.zeros(w.numel()) for w in weights]
    for step in range(6):
        x, y = batches(step, sizes=BIG)
        opt.zero_grad()
        loss_fn(model, shard(x), shard(y)).backward()
        local = [w.grad.detach().reshape(-1) + wd * w.detach().reshape(-1) for w in weights]
        opt.step()
        pairs = dict((name, (idx, vals)) for name, idx, vals in opt.dgc_sent())
        for t, (w, name) in enumerate(zip(weights, ("0.weight", "2.weight"))):
            idx, vals = pairs[name]
            assert idx.numel() == math.ceil(density * w.numel())
            assert vals.dtype == (torch.float16 if fp16 else torch.float64)
            u[t] = local[t].clone() if u[t] is None else m * u[t] + local[t]
            accumulated[t] += local[t] + m * u[t] if nesterov else u[t]
            sent[t].index_add_(0, idx.long(), vals.to(torch.float64))
            if masking:
                u[t][idx.long()] = 0
            residual = opt.dgc_state(w)["dgc_residual"].reshape(-1)
            assert torch.allclose(sent[t] + residual, accumulated[t], rtol=0, atol=1e-12), \
                (sent[t] + residual - accumulated[t]).abs().max()
            assert torch.allclose(opt.dgc_state(w)["dgc_velocity"].reshape(-1), u[t],
                                  rtol=0, atol=1e-12)


# ---- consistency, checkpoints ----------------------------------------------------------------
WIDE = (512, 256, 10)  # a 131072-element weight: large enough for the sampled selection


def train_wide(model, opt, steps, start=0, check_ranks=False):
    for step in range(start, start + steps):
        x, y = batches(step, per_rank=8, sizes=WIDE)
        opt.zero_grad()
        loss_fn(model, shard(x), shard(y)).backward()
        opt.step()
        if check_ranks:
            assert_ranks_identical(model)


def wide_dgc_optimizer(model, **kwargs):
    opts = dict(density=0.001, warmup_steps=4, min_numel=1024)
    opts.update(kwargs)
    return hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                        weight_decay=1e-4),
        named_parameters=model.named_parameters(), compression=hvd.Compression.dgc(**opts))


@pytest.mark.parametrize("fp16", [False, True])
def test_all_ranks_hold_identical_parameters_after_every_step(fp16):
    model = make_model(2, WIDE)
    opt = wide_dgc_optimizer(model, fp16_values=fp16)
    train_wide(model, opt, steps=8, check_ranks=True)
    stats = opt.dgc_stats()
    assert stats["density"] == 0.001
    assert stats["selected"] == math.ceil(0.001 * 512 * 256) + math.ceil(0.001 * 256 * 10)
    assert any(1 <= path <= 3 for path in stats["paths"]), stats  # the sampled threshold
    # header (2 counts) + 135 int32 indices + 135 values, padded to 8 bytes
    assert stats["sparse_bytes"] == (8 + 540 + 270 + 6 if fp16 else 8 + 540 + 540)
    assert stats["dense_bytes"] == 4 * (256 + 10)


def test_checkpoint_and_resume_give_identical_results():
    model = make_model(3, WIDE)
    opt = wide_dgc_optimizer(model, warmup_steps=6)
    train_wide(model, opt, steps=4)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    state = opt.state_dict()
    assert state["dgc"]["step"] == 4
    assert any("dgc_residual" in s and "dgc_velocity" in s for s in state["state"].values())
    assert opt.dgc_state(model[0].weight)["dgc_residual"].abs().sum() > 0
    train_wide(model, opt, steps=5, start=4)

    buf.seek(0)
    checkpoint = torch.load(buf)
    resumed = make_model(4, WIDE)  # different initial weights: everything must come back
    resumed.load_state_dict(checkpoint["model"])
    opt2 = wide_dgc_optimizer(resumed, warmup_steps=6)
    opt2.load_state_dict(checkpoint["opt"])
    assert opt2.dgc_density() == 0.015625  # step 4 of a 6-step warm-up: stage floor(4*4/6) = 2
    train_wide(resumed, opt2, steps=5, start=4)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)

    # Control: without the optimizer state (residual, velocity, warm-up step) it differs.
    fresh = make_model(4, WIDE)
    fresh.load_state_dict(checkpoint["model"])
    train_wide(fresh, wide_dgc_optimizer(fresh, warmup_steps=6), steps=5, start=4)
    assert max_diff(model, fresh) > 0


def test_resuming_a_dense_checkpoint_keeps_the_momentum(float64):
    """DGC adopts the dense momentum buffers as velocities, so switching a dense run to DGC
    (density 1, no masking) continues exactly as dense momentum SGD would."""
    make_opt = SGD_CONFIGS["nesterov_wd"]
    dense, dense_opt = train_dgc(make_opt, steps=3, compression=hvd.Compression.none)
    checkpoint = copy.deepcopy({"model": dense.state_dict(), "opt": dense_opt.state_dict()})
    model = make_model()
    model.load_state_dict(checkpoint["model"])
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   compression=exact_dgc())
    opt.load_state_dict(checkpoint["opt"])
    for step in range(3, 6):
        for m, o in ((dense, dense_opt), (model, opt)):
            x, y = batches(step)
            o.zero_grad()
            loss_fn(m, shard(x), shard(y)).backward()
            o.step()
    assert max_diff(model, dense) < 1e-12
    assert "momentum_buffer" not in opt.state[model[0].weight]  # moved into the velocity


# ---- clipping --------------------------------------------------------------------------------
@pytest.mark.parametrize("local", [True, False])
def test_gradient_clipping(float64, local):
    clip, lr, steps = 0.05, 0.1, 3
    n = hvd.size()
    model, opt = None, None
    model = make_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters(),
        compression=exact_dgc(clip_norm=clip, local_clipping=local))
    reference = make_model()
    for step in range(steps):
        x, y = batches(step)
        opt.zero_grad()
        loss_fn(model, shard(x), shard(y)).backward()
        opt.step()
        # Independent reference: every rank's local gradient, clipped as the paper says.
        grads = []
        for r in range(n):
            reference.zero_grad()
            loss_fn(reference, shard(x, r), shard(y, r)).backward()
            g = [p.grad.clone() for p in reference.parameters()]
            if local:
                norm = math.sqrt(sum(float((t ** 2).sum()) for t in g))
                coef = min(1.0, (clip / math.sqrt(n)) / (norm + 1e-6))
                g = [t * coef for t in g]
            grads.append(g)
        avg = [sum(gs) / n for gs in zip(*grads)]
        if not local:
            norm = math.sqrt(sum(float((t ** 2).sum()) for t in avg))
            avg = [t * min(1.0, clip / (norm + 1e-6)) for t in avg]
        with torch.no_grad():
            for p, g in zip(reference.parameters(), avg):
                p -= lr * g
    assert max_diff(model, reference) < 1e-12
    unclipped, _ = train_dgc(lambda ps: torch.optim.SGD(ps, lr=lr), steps, exact_dgc())
    assert max_diff(model, unclipped) > 1e-6  # the clip threshold was actually hit


# ---- Horovod behaviour -------------------------------------------------------------------------
def test_zero_grad_guard_and_synchronize_pattern():
    model = make_model(0, BIG)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.dgc(density=0.01, min_numel=0,
                                                                   warmup_densities=()))
    x, y = batches(0, sizes=BIG)
    loss_fn(model, shard(x), shard(y)).backward()
    if hvd.size() > 1:
        # The dense tensors' allreduces already started from the backward hooks.
        started = [p for p, (h, _) in opt._handles.items() if h is not None]
        assert {id(p) for p in started} == {id(model[0].bias), id(model[2].bias)}
        with pytest.raises(AssertionError):  # as Horovod: no hooks, no guard, on 1 rank
            opt.zero_grad()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    assert_ranks_identical(model)


def test_step_after_synchronize_without_skip_does_not_exchange_twice(float64):
    make_opt = SGD_CONFIGS["momentum"]
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   compression=exact_dgc())
    for step in range(4):
        x, y = batches(step)
        opt.zero_grad()
        loss_fn(model, shard(x), shard(y)).backward()
        opt.synchronize()
        with pytest.warns(UserWarning, match="skip_synchronize"):
            opt.step()
    assert max_diff(model, train_reference(make_opt, steps=4)) < 1e-12
    assert opt.dgc_stats()["step"] == 3  # one exchange per step


def test_epoch_based_warmup_with_set_epoch():
    model = make_model(0, BIG)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.dgc(density=0.001, warmup_epochs=2, min_numel=0))
    expected = {0: 0.25, 0.5: 0.0625, 1.0: 0.015625, 1.5: 0.004, 2.0: 0.001, 3.0: 0.001}
    for step, (epoch, density) in enumerate(expected.items()):
        opt.set_epoch(epoch)
        assert opt.dgc_density() == density
        x, y = batches(step, sizes=BIG)
        opt.zero_grad()
        loss_fn(model, shard(x), shard(y)).backward()
        opt.step()
        stats = opt.dgc_stats()
        assert stats["density"] == density
        assert stats["selected"] == math.ceil(density * 2048) + math.ceil(density * 256)
    assert opt.state_dict()["dgc"]["epoch"] == 3.0


def test_parameter_without_gradient_on_some_ranks():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.a = torch.nn.Linear(32, 64)
            self.b = torch.nn.Linear(32, 64)

        def forward(self, x):
            # Odd ranks never use head b: its gradient stays None there.
            return self.a(x) + (self.b(x) if hvd.rank() % 2 == 0 else 0)

    model = TwoHeads()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.dgc(density=0.01, min_numel=0,
                                                                   warmup_steps=2))
    for step in range(4):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step + 10 * hvd.rank()))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        assert_ranks_identical(model)


def test_non_sgd_optimizer_gets_error_feedback_only():
    model = make_model(0, BIG)
    with pytest.warns(RuntimeWarning, match="not SGD-like"):
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.dgc(density=0.01, min_numel=0,
                                                                       warmup_densities=()))
    assert isinstance(opt, torch.optim.Adam)
    for step in range(3):
        x, y = batches(step, sizes=BIG)
        opt.zero_grad()
        loss_fn(model, shard(x), shard(y)).backward()
        opt.step()
        assert_ranks_identical(model)
    assert set(opt.dgc_state(model[0].weight)) == {"dgc_residual"}
    assert "exp_avg" in opt.state[model[0].weight]
    saved = opt.state_dict()["state"][0]
    assert "dgc_residual" in saved and "exp_avg" in saved


def test_compression_dgc_class_uses_defaults():
    model = make_model(0, WIDE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.dgc)
    opt.set_epoch(0)
    train_wide(model, opt, steps=1)
    stats = opt.dgc_stats()
    assert stats["density"] == 0.25
    assert stats["compressed_elements"] == 512 * 256 + 256 * 10  # default min_numel=1024
    with pytest.raises(ValueError, match="op=Average and op=Sum"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(),
                                 compression=hvd.Compression.dgc, op=hvd.Max)


def test_options_without_meaning_for_dgc_warn():
    model = make_model(0, WIDE)
    for kwargs in (dict(groups=2), dict(sparse_as_dense=True)):
        with pytest.warns(UserWarning, match="groups= and sparse_as_dense= have no effect"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.dgc(), **kwargs)



# ---- the device path (torch ops), as it runs on CUDA gradients ---------------------------------
@pytest.mark.parametrize("fp16,masking", [(False, True), (True, True), (False, False)])
def test_device_path_gives_the_compiled_path_bits(fp16, masking, monkeypatch):
    """The torch-op selection, compensation and slot exchange (what runs on a GPU) train to
    the same bits as the compiled CPU kernels, and take the sampled path."""
    from aiak_training.dgc import _kernels
    if not _kernels.native_available():
        pytest.skip("compiled kernels not built")
    runs = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(_kernels, "ext", None)
        model = make_model(2, WIDE)
        opt = wide_dgc_optimizer(model, fp16_values=fp16, momentum_masking=masking)
        train_wide(model, opt, steps=7)
        runs.append((model, opt.dgc_sent(), opt.dgc_stats(), opt))
    (m0, sent0, stats0, opt0), (m1, sent1, stats1, opt1) = runs
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    for (n0, i0, v0), (n1, i1, v1) in zip(sent0, sent1):
        assert n0 == n1 and torch.equal(i0, i1) and torch.equal(v0, v1)
    assert stats1["paths"].get(1, 0) >= 1, stats1  # the sampled threshold sufficed
    assert stats0["selected"] == stats1["selected"]
    for p0, p1 in zip(m0.parameters(), m1.parameters()):
        s0, s1 = opt0.dgc_state(p0), opt1.dgc_state(p1)
        assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert_ranks_identical(m1)


def test_device_path_step_reads_the_device_once(monkeypatch):
    """One host read of device data per step for all compressed tensors (the counts), none
    per tensor: counted on the CPU with the GPU branch of the compaction."""
    from aiak_training.dgc import _kernels, device_select
    monkeypatch.setattr(_kernels, "ext", None)
    monkeypatch.setattr(device_select, "compact", device_select.compact_scatter)
    sizes = (WIDE[0], WIDE[1], WIDE[2])
    model = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.Tanh(),
                                torch.nn.Linear(sizes[1], sizes[1]), torch.nn.Tanh(),
                                torch.nn.Linear(sizes[1], sizes[2]))
    opt = wide_dgc_optimizer(model, min_numel=100)
    assert len(opt._dgc_sparse) == 3
    train_wide(model, opt, steps=5)  # through the warm-up: the headers are made once each
    reads = []
    real = device_select.resolve

    def counted(*args):
        reads.append(1)
        return real(*args)
    monkeypatch.setattr(device_select, "resolve", counted)
    calls = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        fn = getattr(torch.Tensor, name)

        def wrap(self, *a, _fn=fn, _name=name, **kw):
            calls.append(_name)
            return _fn(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, wrap)
    opt._dgc_compress_all(opt.dgc_density())
    assert calls == ["tolist"] and reads == [1]
