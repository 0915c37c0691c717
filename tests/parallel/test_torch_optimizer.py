"""DistributedOptimizer and SyncBatchNorm against single-process full-batch references."""
import copy

import pytest
import torch

import aiak_training.torch as hvd



@pytest.fixture(autouse=True)
def float64_default():
    """Exact comparisons: train in float64 (restored afterwards for other modules)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches(step, micro=0, per_rank=4):
    """Every rank's shard of one (micro)batch; identical on every rank."""
    g = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    x = torch.randn(hvd.size() * per_rank, 6, generator=g)
    y = torch.randn(hvd.size() * per_rank, 3, generator=g)
    return x, y


def shard(t):
    n = t.shape[0] // hvd.size()
    return t[hvd.rank() * n:(hvd.rank() + 1) * n]


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
}


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


def train_distributed(make_opt, steps, passes=1, **kwargs):
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, y = batches(step, micro)
            loss_fn(model, shard(x), shard(y)).backward()
        opt.step()
    return model, opt


def assert_models_close(a, b, atol=1e-12):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=atol, rtol=0), (name, (pa - pb).abs().max())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_matches_full_batch_training(name):
    model, opt = train_distributed(OPTIMIZERS[name], steps=6)
    assert_models_close(model, train_reference(OPTIMIZERS[name], steps=6))
    assert isinstance(opt, type(OPTIMIZERS[name]([torch.zeros(1, requires_grad=True)])))


def test_backward_passes_per_step():
    model, _ = train_distributed(OPTIMIZERS["sgd"], steps=4, passes=2)
    assert_models_close(model, train_reference(OPTIMIZERS["sgd"], steps=4, passes=2))


@pytest.mark.parametrize("groups", [2, "explicit"])
def test_groups(groups):
    model = make_model()
    ps = list(model.parameters())
    groups_arg = 2 if groups == 2 else [[ps[0], ps[2]]]
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()),
                                   named_parameters=model.named_parameters(), groups=groups_arg)
    for step in range(4):
        opt.zero_grad()
        x, y = batches(step)
        loss_fn(model, shard(x), shard(y)).backward()
        opt.step()
    assert_models_close(model, train_reference(OPTIMIZERS["adam"], steps=4))


def test_groups_leave_out_frozen_and_foreign_tensors():
    """As Horovod: a listed tensor without a gradient (frozen, or not a parameter of the
    optimizer) is left out of its group, so it is never given a gradient or updated."""
    def train(groups_of):
        model = make_model()
        model[2].bias.requires_grad_(False)
        ps = list(model.parameters())
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5),
            named_parameters=model.named_parameters(), groups=groups_of(ps))
        for step in range(3):
            opt.zero_grad()
            x, y = batches(step)
            loss_fn(model, shard(x), shard(y)).backward()
            opt.step()
        return model
    stranger = torch.zeros(3, requires_grad=True)
    grouped = train(lambda ps: [[ps[0], ps[3], stranger], [ps[2], ps[1]]])
    plain = train(lambda ps: None)
    assert grouped[2].bias.grad is None
    assert torch.equal(grouped[2].bias, make_model()[2].bias)
    assert_models_close(grouped, plain, atol=1e-12)


def test_adasum_runs_the_plain_optimizer_on_one_process():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if hvd.size() > 1:
        # More ranks: the delta optimizer, checked against a reference in test_adasum.py.
        dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        op=hvd.Adasum)
        assert isinstance(dist, torch.optim.SGD)
        with pytest.raises(AssertionError, match="skip_synchronize"):
            with dist.skip_synchronize():
                pass
        return
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum)
    x, y = batches(0)
    loss_fn(model, x, y).backward()
    opt.step()
    ref = make_model()
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_fn(ref, x, y).backward()
    plain.step()
    assert_models_close(model, ref, atol=0)


def test_gradient_predivide_factor_and_fp16_compression():
    model, _ = train_distributed(OPTIMIZERS["sgd"], steps=3, gradient_predivide_factor=4.0)
    assert_models_close(model, train_reference(OPTIMIZERS["sgd"], steps=3), atol=1e-12)
    model, _ = train_distributed(OPTIMIZERS["sgd"], steps=3, compression=hvd.Compression.fp16)
    assert_models_close(model, train_reference(OPTIMIZERS["sgd"], steps=3), atol=5e-3)


def test_sum_op_and_synchronize_with_clipping():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    x, y = batches(0)
    loss_fn(model, shard(x), shard(y)).backward()
    opt.synchronize()
    ref = make_model()
    local_grads = []
    for r in range(hvd.size()):
        ref.zero_grad()
        n = x.shape[0] // hvd.size()
        loss_fn(ref, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]).backward()
        local_grads.append([p.grad.clone() for p in ref.parameters()])
    for i, p in enumerate(model.parameters()):
        assert torch.allclose(p.grad, sum(g[i] for g in local_grads), atol=1e-12, rtol=0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with opt.skip_synchronize():
        opt.step()
    total = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert total <= 0.5 + 1e-9


def test_unused_parameter_on_some_ranks():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    params = list(a.parameters()) + list(b.parameters())
    named = [("a.w", a.weight), ("a.b", a.bias), ("b.w", b.weight), ("b.b", b.bias)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), named_parameters=named)
    x = torch.ones(2, 3)
    out = a(x).sum()
    if hvd.rank() == 0:
        out = out + b(x).sum()   # only rank 0 touches b
    out.backward()
    opt.synchronize()
    # b's gradient is rank 0's, averaged with zeros from the others.
    assert torch.allclose(b.weight.grad, torch.full((1, 3), 2.0 / hvd.size()))
    assert torch.allclose(a.weight.grad, torch.full((1, 3), 2.0))
    with opt.skip_synchronize():
        opt.step()


def test_misuse_is_reported():
    model = make_model()
    if hvd.size() > 1:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        x, y = batches(0)
        loss_fn(model, shard(x), shard(y)).backward()
        with pytest.raises(AssertionError, match="zero_grad"):
            opt.zero_grad()
        with pytest.raises(AssertionError, match="backward_passes_per_step"):
            loss_fn(model, shard(x), shard(y)).backward()
        opt.synchronize()
        with pytest.warns(UserWarning, match="skip_synchronize"):
            opt.step()
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("same", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)


def test_lr_scheduler_and_state_dict_roundtrip():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        opt.zero_grad()
        x, y = batches(step)
        loss_fn(model, shard(x), shard(y)).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    state = copy.deepcopy(opt.state_dict())
    plain = torch.optim.SGD(make_model().parameters(), lr=1.0, momentum=0.9)
    plain.load_state_dict(state)
    assert plain.param_groups[0]["lr"] == pytest.approx(0.0125)


def test_sync_batch_norm_matches_full_batch():
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(hvd.size() * 3, 4, 5, generator=g)
    w_all = torch.randn(hvd.size() * 3, 4, 5, generator=g)
    sbn = hvd.SyncBatchNorm(4)
    bn = torch.nn.BatchNorm1d(4)
    with torch.no_grad():
        for m in (sbn, bn):
            m.weight.copy_(torch.linspace(0.5, 2.0, 4))
            m.bias.copy_(torch.linspace(-1.0, 1.0, 4))
    x_mine = shard(x_all).clone().requires_grad_(True)
    out = sbn(x_mine)
    (out * shard(w_all)).sum().backward()
    x_ref = x_all.clone().requires_grad_(True)
    ref = bn(x_ref)
    (ref * w_all).sum().backward()
    assert torch.allclose(out, shard(ref), atol=1e-10)
    assert torch.allclose(x_mine.grad, shard(x_ref.grad), atol=1e-10)
    # Parameter gradients are local contributions; their sum over ranks is the reference.
    wgrad = hvd.allreduce(sbn.weight.grad, op=hvd.Sum)
    assert torch.allclose(wgrad, bn.weight.grad, atol=1e-10)
    assert torch.allclose(sbn.running_mean, bn.running_mean, atol=1e-12)
    assert torch.allclose(sbn.running_var, bn.running_var, atol=1e-12)
    sbn.eval()
    bn.eval()
    assert torch.allclose(sbn(x_all), bn(x_all), atol=1e-12)


def test_sync_batch_norm_eval_without_running_stats_uses_synchronized_batch_stats():
    g = torch.Generator().manual_seed(6)
    x_all = torch.randn(hvd.size() * 3, 4, 5, generator=g) * 3 + 1
    sbn = hvd.SyncBatchNorm(4, track_running_stats=False).eval()
    bn = torch.nn.BatchNorm1d(4, track_running_stats=False).eval()
    assert sbn.running_mean is None
    # As in Horovod: batch statistics, taken over every rank's batch, also in eval mode.
    assert torch.allclose(sbn(shard(x_all)), shard(bn(x_all)), atol=1e-10)


def _adam_with_rank_options():
    model = make_model(seed=hvd.rank())
    model[2].bias.requires_grad_(False)
    me = hvd.rank()
    groups = [{"params": model[0].parameters(), "lr": 0.5 + me, "weight_decay": 0.1 * me},
              {"params": model[2].parameters(), "betas": (0.5 + 0.1 * me, 0.9 - 0.01 * me)}]
    return model, torch.optim.Adam(groups, lr=0.01 * (me + 1), betas=(0.8, 0.95 + 0.001 * me))


def test_broadcast_optimizer_state_fresh_optimizer_gets_root_options_and_state():
    root = hvd.size() - 1
    model, opt = _adam_with_rank_options()
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    g0, g1 = opt.param_groups
    assert (g0["lr"], g0["betas"], g0["weight_decay"]) == (0.5 + root, (0.8, 0.95 + 0.001 * root),
                                                          0.1 * root)
    assert g1["betas"] == (0.5 + 0.1 * root, 0.9 - 0.01 * root) and type(g1["betas"]) is tuple
    assert (g1["lr"], g1["weight_decay"]) == (0.01 * (root + 1), 0)
    # One zero-gradient step created the state; the frozen bias has none.
    state = opt.state_dict()["state"]
    assert sorted(state) == [0, 1, 2]
    ref = hvd.allgather_object(state)[root]
    for pid, entries in state.items():
        assert sorted(entries) == ["exp_avg", "exp_avg_sq", "step"]
        assert float(entries["step"]) == 1.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entries[key], ref[pid][key]), (pid, key)
    # Without weight decay (group 1) a zero gradient leaves zero moments.
    assert not state[2]["exp_avg"].any() and not state[2]["exp_avg_sq"].any()
    assert all(not p.grad.any() for p in model.parameters() if p.requires_grad)


def test_broadcast_optimizer_state_copies_root_state_exactly():
    root = 0
    model, opt = _adam_with_rank_options()
    for step in range(hvd.rank() + 1):  # different state (and step counts) on every rank
        opt.zero_grad()
        x, y = batches(step)
        loss_fn(model, shard(x), shard(y)).backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    mine = opt.state_dict()
    everyone = hvd.allgather_object(mine)
    ref = everyone[root]
    assert mine["param_groups"] == ref["param_groups"]
    assert sorted(mine["state"]) == sorted(ref["state"]) == [0, 1, 2]
    for pid, entries in ref["state"].items():
        assert float(entries["step"]) == 1.0
        for key, value in entries.items():
            assert torch.equal(mine["state"][pid][key], value), (pid, key)


@pytest.mark.parametrize("momentum", [None, 0.3])
def test_sync_batch_norm_running_stats_over_steps(momentum):
    sbn = hvd.SyncBatchNorm(3, momentum=momentum, affine=False)
    bn = torch.nn.BatchNorm2d(3, momentum=momentum, affine=False)
    for step in range(3):
        g = torch.Generator().manual_seed(40 + step)
        x_all = torch.randn(hvd.size() * 2, 3, 2, 2, generator=g) * (step + 1) + step
        assert torch.allclose(sbn(shard(x_all)), shard(bn(x_all)), atol=1e-10)
    assert int(sbn.num_batches_tracked) == 3
    assert torch.allclose(sbn.running_mean, bn.running_mean, atol=1e-12)
    assert torch.allclose(sbn.running_var, bn.running_var, atol=1e-12)
