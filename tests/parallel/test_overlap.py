"""overlap_update=True against the synchronous DistributedOptimizer (issue 6).

Equivalence is bitwise (torch.equal) in fp32: both paths run the same optimizer arithmetic on
the same reduced gradients, so any difference is a bug (an update from an unreduced or
half-reduced gradient, a double update, a missed parameter, a per-bucket step count).  The
gradient seen by each update is also checked against an average computed here, independently,
from every rank's data.
"""
import time
import warnings

import pytest
import torch

import aiak_training.torch as hvd
from aiak_training.runtime import current
from aiak_training.fused_optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD
from aiak_training.torch.optim import overlap as ov
from aiak_training.torch.optim.allreduce import GRAD_SCALER_BEFORE_SYNC

STEPS = 20


# ---- model, data, training loop -------------------------------------------------------------
class Net(torch.nn.Module):
    """Tied weights (embed is also the output projection), a block only some ranks use on some
    steps (and no rank on others), a frozen layer the optimizer holds, and enough tensors to
    make several buckets."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 16, bias=False)
        self.hidden = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(4)])
        self.extra = torch.nn.Linear(16, 16)
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.out_bias = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x, use_extra: bool):
        h = torch.tanh(self.embed(x))
        for i, layer in enumerate(self.hidden):
            h = torch.tanh(layer(h))
            if i == 1 and use_extra:
                h = h + torch.tanh(self.extra(h))
        h = h + 0.1 * self.frozen(h)
        return h @ self.embed.weight + self.out_bias  # the tied use


def use_extra(step: int, rank: int) -> bool:
    """Some ranks on most steps; no rank at all when step % 4 == 3."""
    return step % 4 != 3 and (step + rank) % 3 == 0


def data(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(100_000 + 1000 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def loss_of(model, step, micro, rank):
    x, y = data(step, micro, rank)
    return ((model(x, use_extra(step, rank)) - y) ** 2).mean()


class Splitter:
    """Makes Engine.wait_any hand back one completed handle at a time while ``active``, so
    every handle becomes its own bucket (the most partial updates a step can have)."""

    def __init__(self, monkeypatch):
        self.active = False
        engine = current.engine()
        real = engine.wait_any

        def wait_any(handles, timeout=None):
            done = real(handles, timeout)
            return done[:1] if self.active else done
        monkeypatch.setattr(engine, "wait_any", wait_any)


@pytest.fixture
def splitter(monkeypatch):
    return Splitter(monkeypatch)


def train(make_opt, overlap, steps=STEPS, passes=1, splitter=None, **kwargs):
    """Train a fresh Net; the learning rate changes between steps (LambdaLR), zero_grad
    alternates between set_to_none and zeroing in place."""
    model = Net()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, overlap_update=overlap,
                                   **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.25 * (s % 5)))
    for step in range(steps):
        if splitter is not None:
            splitter.active = step % 2 == 1
        opt.zero_grad(set_to_none=step % 2 == 0)
        for micro in range(passes):
            loss_of(model, step, micro, hvd.rank()).backward()
        opt.step()
        sched.step()
    if splitter is not None:
        splitter.active = False
    return model, opt


def trainable_names(model):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def assert_bitwise_equal(ref_model, ref_opt, model, opt):
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), (name, (a - b).abs().max().item())
    sa, sb = ref_opt.state_dict(), opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for pid, st in sa["state"].items():
        assert st.keys() == sb["state"][pid].keys(), pid
        for key, value in st.items():
            other = sb["state"][pid][key]
            if torch.is_tensor(value):
                assert torch.equal(value, other), (pid, key)
            else:
                assert value == other, (pid, key)


def assert_steps_counted(model, opt, steps):
    """Per-parameter step counts advance once per iteration: every trainable parameter
    (including the one with no gradient on some steps) has exactly ``steps``; the frozen
    layer was never stepped (Adagrad creates its state eagerly, at step 0)."""
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        if not p.requires_grad:
            assert float(state.get("step", 0)) == 0, name
        elif "step" in state:
            assert float(state["step"]) == steps, (name, float(state["step"]))


# ---- optimizers ------------------------------------------------------------------------------
# The optimizers the issue lists; each runs with and without backward_passes_per_step=2.
OPTIMIZERS = {
    "sgd_momentum_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                           nesterov=True, weight_decay=1e-3),
    "adam_wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "fused_sgd": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "fused_adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=1e-3),
    "fused_adamw": lambda ps: FusedAdamW(ps, lr=1e-2, weight_decay=0.1),
    "fused_lamb_no_clip": lambda ps: FusedLAMB(ps, lr=1e-2, max_grad_norm=0.0),
}
# The torch implementations besides the for-loop one (CPU default): foreach and fused, with
# one backward_passes_per_step setting each.
VARIANTS = {
    "sgd_dampening_foreach": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8,
                                                         dampening=0.3, foreach=True), 2),
    "adam_foreach_amsgrad": (lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True,
                                                         foreach=True), 1),
    "adam_fused": (lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), 2),
    "adamw_foreach": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1,
                                                   foreach=True), 1),
}
OTHER_TORCH = {
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
}


CASES = [(n, OPTIMIZERS[n], passes) for n in OPTIMIZERS for passes in (1, 2)] + \
    [(n, make, passes) for n, (make, passes) in VARIANTS.items()]


@pytest.mark.parametrize("name,make,passes", CASES, ids=[f"{n}-passes{p}" for n, _, p in CASES])
def test_bitwise_equal_to_synchronous(name, make, passes, splitter):
    ref_model, ref_opt = train(make, overlap=False, passes=passes)
    model, opt = train(make, overlap=True, passes=passes, splitter=splitter)
    assert_bitwise_equal(ref_model, ref_opt, model, opt)
    assert_steps_counted(model, opt, STEPS)
    stats = opt.overlap_stats()
    if hvd.size() > 1:
        assert stats["overlapped_steps"] == STEPS and not stats["fallback_steps"], stats
        # Odd steps ran one handle per bucket: far more than one partial update per step.
        assert stats["buckets"] >= STEPS + (STEPS // 2) * 4, stats
        assert stats["param_updates"] == STEPS * len(trainable_names(model)), stats


@pytest.mark.parametrize("name", list(OTHER_TORCH))
def test_other_torch_optimizers_bitwise(name, splitter):
    ref_model, ref_opt = train(OTHER_TORCH[name], overlap=False, steps=8)
    model, opt = train(OTHER_TORCH[name], overlap=True, steps=8, splitter=splitter)
    assert_bitwise_equal(ref_model, ref_opt, model, opt)
    assert_steps_counted(model, opt, 8)


@pytest.mark.parametrize("options", ["fp16_compression", "groups", "sum_predivide"])
def test_other_reduction_options_bitwise(options, splitter):
    kwargs = {"fp16_compression": {"compression": hvd.Compression.fp16},
              "groups": {"groups": 3},
              "sum_predivide": {"gradient_predivide_factor": 2.0}}[options]
    make = OPTIMIZERS["adam_wd"]
    ref_model, ref_opt = train(make, overlap=False, steps=6, **kwargs)
    model, opt = train(make, overlap=True, steps=6, splitter=splitter, **kwargs)
    assert_bitwise_equal(ref_model, ref_opt, model, opt)
    if hvd.size() > 1:
        assert opt.overlap_stats()["overlapped_steps"] == 6


def test_state_dict_keeps_wrapped_format():
    model, opt = train(OPTIMIZERS["adam_wd"], overlap=True, steps=3)
    sd = opt.state_dict()
    plain_model = Net()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1.0)
    plain.load_state_dict(sd)
    for p, q in zip(model.parameters(), plain_model.parameters()):
        if p.requires_grad:
            assert torch.equal(opt.state[p]["exp_avg"], plain.state[q]["exp_avg"])
            assert float(plain.state[q]["step"]) == 3
    assert set(sd) == {"state", "param_groups"}


# ---- ordering: an update never runs before its own reduction finished -------------------------
class Recorder(torch.optim.SGD):
    """Records, for every update, the gradient it saw and counts updates per parameter.  lr=0:
    parameters never change, so the reference gradients are easy to recompute."""
    aiak_overlap_update_safe = True

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.calls = 0
        self.seen = []

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["updates"] = state.get("updates", 0) + 1
                    self.seen.append((p, p.grad.clone()))


def averaged_grads(step):
    """Every rank's local gradients, rebuilt here and averaged in float64 (independent of the
    library: no collective involved)."""
    total = None
    for r in range(hvd.size()):
        ref = Net()
        loss_of(ref, step, 0, r).backward()
        grads = [p.grad.double() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64)
                 for p in ref.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [(t / hvd.size()).float() for t in total]


def _run_delayed(model, opt, step, finish_late=None):
    opt.zero_grad()
    opt.seen.clear()
    if hvd.rank() == hvd.size() - 1:
        time.sleep(0.3)  # the others' reductions cannot finish before this rank submits
    loss_of(model, step, 0, hvd.rank()).backward()
    opt.step()
    if finish_late is not None:
        finish_late()


def _mismatches(model, opt, expected):
    index = {p: i for i, p in enumerate(model.parameters())}
    bad = 0
    for p, g in opt.seen:
        if not torch.allclose(g, expected[index[p]], atol=1e-6, rtol=1e-5):
            bad += 1
    return bad


def needs_ranks():
    if hvd.size() < 2:
        pytest.skip("needs at least 2 ranks")


def test_update_sees_the_averaged_gradient():
    needs_ranks()
    model = Net()
    opt = hvd.DistributedOptimizer(Recorder(model.parameters()),
                                   named_parameters=model.named_parameters(), overlap_update=True)
    for step in range(3):
        _run_delayed(model, opt, step)
        assert len(opt.seen) == len(trainable_names(model))
        assert _mismatches(model, opt, averaged_grads(step)) == 0
    assert opt.overlap_stats()["overlapped_steps"] == 3


def test_check_catches_an_update_before_its_reduction(monkeypatch):
    """Negative control: with a deliberately broken step (it does not wait for completion and
    does not finish the reduction before updating), the check above fails on the ranks that
    did not delay."""
    needs_ranks()
    model = Net()
    opt = hvd.DistributedOptimizer(Recorder(model.parameters()),
                                   named_parameters=model.named_parameters(), overlap_update=True)
    engine = current.engine()
    monkeypatch.setattr(engine, "wait_any", lambda handles, timeout=None: list(handles))
    deferred = []
    real_finish = opt._finish_reduction
    monkeypatch.setattr(opt, "_finish_reduction", lambda *a: deferred.append(a))

    def finish_late():
        for args in deferred:
            real_finish(*args)
        deferred.clear()
    _run_delayed(model, opt, 0, finish_late)
    if hvd.rank() != hvd.size() - 1:
        assert _mismatches(model, opt, averaged_grads(0)) > 0


@pytest.mark.parametrize("passes", [1, 2])
def test_every_parameter_updated_exactly_once_per_step(passes, splitter):
    model = Net()
    late = torch.nn.Parameter(torch.ones(8))  # added after wrapping: no hook, local gradient
    opt = hvd.DistributedOptimizer(Recorder(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, overlap_update=True)
    opt.add_param_group({"params": [late]})
    trainable = [p for p in model.parameters() if p.requires_grad] + [late]
    steps = 6
    for step in range(steps):
        splitter.active = step % 2 == 1
        opt.zero_grad()
        calls_before = opt.calls
        for micro in range(passes):
            (loss_of(model, step, micro, hvd.rank()) + (late * late).sum()).backward()
        opt.step()
        for p in trainable:
            assert opt.state[p]["updates"] == step + 1
        assert not opt.state.get(model.frozen.weight) and not opt.state.get(model.frozen.bias)
        if hvd.size() > 1 and splitter.active:
            assert opt.calls - calls_before > 4  # really updated in several buckets
    if hvd.size() > 1:
        stats = opt.overlap_stats()
        assert stats["param_updates"] == steps * len(trainable), stats
        assert stats["overlapped_steps"] == steps


# ---- fallbacks -------------------------------------------------------------------------------
def _overlap_warnings(caplog):
    return [r for r in caplog.records if r.name == "aiak_training" and "overlap_update" in r.getMessage()]


def test_fallback_gradient_clipping_after_synchronize(caplog):
    def run(overlap):
        model = Net()
        opt = hvd.DistributedOptimizer(OPTIMIZERS["adam_wd"](model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       overlap_update=overlap)
        for step in range(4):
            opt.zero_grad()
            loss_of(model, step, 0, hvd.rank()).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
        return model, opt
    ref_model, ref_opt = run(False)
    caplog.clear()
    model, opt = run(True)
    assert_bitwise_equal(ref_model, ref_opt, model, opt)
    if hvd.size() > 1:
        assert opt.overlap_stats()["fallback_steps"] == {"synchronized": 4}
        msgs = _overlap_warnings(caplog)
        assert len(msgs) == 1 and "synchronize()" in msgs[0].getMessage()


def _train_with_scaler(overlap, pattern, make_opt, inject_inf):
    """Four steps of fp16-style loss scaling; ``pattern`` says how the scale reaches the
    optimizer: "unscale" (Horovod's documented synchronize(); unscale_(); skip_synchronize()),
    "fused_synchronize" (a fused optimizer takes grad_scale/found_inf from GradScaler after
    synchronize()), or "fused_attrs" (grad_scale/found_inf set on the optimizer before a plain
    step(), as GradScaler's newer contract does, without reading the gradients first)."""
    model = Net()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   overlap_update=overlap)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for step in range(4):
        opt.zero_grad()
        loss = loss_of(model, step, 0, hvd.rank())
        if inject_inf and step == 2 and hvd.rank() == 0:
            loss = loss * float("inf")  # one rank overflows: every rank must skip the step
        scaler.scale(loss).backward()
        if pattern == "fused_attrs":
            opt.grad_scale = torch.tensor(2.0 ** 8)  # the fused step divides by it
            opt.found_inf = torch.tensor(0.0)
            opt.step()
            opt.grad_scale = opt.found_inf = None
            continue
        opt.synchronize()
        if pattern == "unscale":
            scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return model, opt, scaler


@pytest.mark.parametrize("pattern", ["unscale", "fused_synchronize", "fused_attrs"])
def test_fallback_grad_scaler(pattern):
    make = OPTIMIZERS["adam_wd"] if pattern == "unscale" else OPTIMIZERS["fused_adam"]
    # GradScaler reads (and rewrites) every gradient before it calls step(), so only the
    # synchronize() patterns may hand it gradients at all; those get an overflowing step.
    inject = pattern != "fused_attrs"
    ref_model, ref_opt, ref_scaler = _train_with_scaler(False, pattern, make, inject)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, scaler = _train_with_scaler(True, pattern, make, inject)
    assert_bitwise_equal(ref_model, ref_opt, model, opt)
    assert scaler.get_scale() == ref_scaler.get_scale()
    raced = [w for w in caught if str(w.message) == GRAD_SCALER_BEFORE_SYNC]
    if hvd.size() > 1:
        reason = "grad_scaler" if pattern == "fused_attrs" else "synchronized"
        assert set(opt.overlap_stats()["fallback_steps"]) == {reason}
        # Set before the reductions finished: the race is reported on every step.
        assert len(raced) == (4 if pattern == "fused_attrs" else 0)
    else:
        assert not raced


def test_fallback_closure_and_step_hooks():
    def run(overlap, mode):
        model = Net()
        opt = hvd.DistributedOptimizer(OPTIMIZERS["sgd_momentum_nesterov_wd"](model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       overlap_update=overlap)
        calls = []
        if mode == "hooks":
            opt.register_step_pre_hook(lambda o, a, k: calls.append(1))
        for step in range(3):
            opt.zero_grad()
            loss_of(model, step, 0, hvd.rank()).backward()
            if mode == "closure":
                opt.step(lambda: float(loss_of(model, step, 0, hvd.rank()).detach()))
            else:
                opt.step()
        return model, opt, len(calls)
    for mode, reason in (("closure", "closure"), ("hooks", "step_hooks")):
        ref_model, ref_opt, ref_calls = run(False, mode)
        model, opt, calls = run(True, mode)
        assert_bitwise_equal(ref_model, ref_opt, model, opt)
        assert calls == ref_calls
        if hvd.size() > 1:
            assert opt.overlap_stats()["fallback_steps"] == {reason: 3}


class SparseNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, idx):
        return self.fc(self.emb(idx)).sum()


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_fallback_sparse_gradients(sparse_as_dense):
    def run(overlap):
        model = SparseNet()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=sparse_as_dense, overlap_update=overlap)
        for step in range(3):
            opt.zero_grad()
            idx = torch.tensor([(step + hvd.rank()) % 10, 3, (2 * step) % 10])
            model(idx).backward()
            opt.step()
        return model, opt
    ref_model, ref_opt = run(False)
    model, opt = run(True)
    assert_bitwise_equal(ref_model, ref_opt, model, opt)
    if hvd.size() > 1:
        assert opt.overlap_stats()["fallback_steps"] == {"sparse": 3}


def test_fallback_lamb_global_norm():
    make = lambda ps: FusedLAMB(ps, lr=1e-2, max_grad_norm=0.5)  # noqa: E731
    ref_model, ref_opt = train(make, overlap=False, steps=4)
    model, opt = train(make, overlap=True, steps=4)
    assert_bitwise_equal(ref_model, ref_opt, model, opt)
    if hvd.size() > 1:
        assert opt.overlap_stats()["fallback_steps"] == {"lamb_global_norm": 4}


def test_unknown_optimizer_and_dgc_fall_back(caplog, monkeypatch):
    class MyAdam(torch.optim.Adam):  # a subclass may change step(): not trusted
        pass
    model = Net()
    opt = hvd.DistributedOptimizer(MyAdam(model.parameters()),
                                   named_parameters=model.named_parameters(), overlap_update=True)
    assert opt.overlap_stats() == {}
    assert any("independently" in r.getMessage() for r in _overlap_warnings(caplog))
    caplog.clear()

    dgc = hvd.Compression.dgc(density=0.25, min_numel=16)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=dgc, overlap_update=True)
    assert any("DGC" in r.getMessage() for r in _overlap_warnings(caplog))
    assert opt.overlap_stats() == {}
    for step in range(2):
        opt.zero_grad()
        loss_of(model, step, 0, hvd.rank()).backward()
        opt.step()
    caplog.clear()
    monkeypatch.setenv(ov.ENV_VAR, "1")  # the env var reaches DGC's optimizer through __init__
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=dgc)
    assert opt.overlap_stats() == {}
    assert any("replaced" in r.getMessage() for r in _overlap_warnings(caplog))


def test_environment_variable(monkeypatch):
    model = Net()
    monkeypatch.setenv(ov.ENV_VAR, "1")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert opt.overlap_stats()["steps"] == 0
    off = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), overlap_update=False)
    assert off.overlap_stats() == {}
    monkeypatch.setenv(ov.ENV_VAR, "0")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert opt.overlap_stats() == {}


def test_zero_grad_before_step_still_raises():
    needs_ranks()
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), overlap_update=True)
    loss_of(model, 0, 0, hvd.rank()).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


# ---- the engine API overlap relies on ----------------------------------------------------------
def test_engine_wait_any():
    needs_ranks()
    engine = current.engine()
    assert engine.wait_any([]) == []
    rank = hvd.rank()
    a = torch.full((3,), float(rank))
    b = torch.full((5,), float(rank + 1))
    ha = hvd.allreduce_async_(a, name="overlap.wait_any.a")
    hb = hvd.allreduce_async_(b, name="overlap.wait_any.b") if rank == 0 else None
    if rank == 0:
        # b cannot complete: the other ranks have not submitted it yet.
        assert engine.wait_any([hb], timeout=0.05) == []
        assert engine.completion_time(hb) is None
    done = engine.wait_any([ha] + ([hb] if hb is not None else []))
    assert done == [ha]  # b is still missing the other ranks
    assert engine.completion_time(ha) is not None
    assert engine.poll(ha)
    hvd.barrier()
    if rank != 0:
        hb = hvd.allreduce_async_(b, name="overlap.wait_any.b")
    got = engine.wait_any([hb])
    assert got == [hb]
    n = hvd.size()
    assert torch.equal(hvd.synchronize(ha), torch.full((3,), (n - 1) / 2.0))
    assert torch.equal(hvd.synchronize(hb), torch.full((5,), (n + 1) / 2.0))
    with pytest.raises(ValueError, match="cleared"):
        engine.wait_any([ha])
    assert engine.completion_time(ha) is None


def test_error_in_an_update_leaves_a_consistent_state(splitter):
    """An exception from the wrapped optimizer mid-step propagates; the remaining reductions
    are finished, so training can go on (no outstanding handles, delays reset)."""
    class Failing(Recorder):
        aiak_overlap_update_safe = True
        fail = True

        def step(self, closure=None):
            if self.fail and self.calls == 2:
                self.calls += 1
                raise RuntimeError("boom")
            return super().step(closure)
    model = Net()
    opt = hvd.DistributedOptimizer(Failing(model.parameters()),
                                   named_parameters=model.named_parameters(), overlap_update=True)
    splitter.active = True
    loss_of(model, 0, 0, hvd.rank()).backward()
    if hvd.size() > 1:
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        assert not opt._handles
    else:
        opt.step()
    opt.fail = False
    for step in range(1, 3):
        opt.zero_grad()
        loss_of(model, step, 0, hvd.rank()).backward()
        opt.step()


def test_min_bucket_bytes_gathers_small_completions(monkeypatch, splitter):
    """AIAK_OVERLAP_MIN_BUCKET_BYTES: completions are gathered until they reach the size (or
    nothing is pending); with a size above the model's, one update per step, same bits."""
    monkeypatch.setenv(ov.MIN_BUCKET_ENV_VAR, str(1 << 30))
    make = OPTIMIZERS["adam_wd"]
    ref_model, ref_opt = train(make, overlap=False, steps=6)
    model, opt = train(make, overlap=True, steps=6, splitter=splitter)
    assert_bitwise_equal(ref_model, ref_opt, model, opt)
    if hvd.size() > 1:
        stats = opt.overlap_stats()
        assert stats["buckets"] == 6 and stats["overlapped_steps"] == 6, stats


# ---- no host synchronisation on the overlapped path (what CUDA gradients need) -----------------
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


@pytest.mark.parametrize("name", ["sgd_momentum_nesterov_wd", "fused_sgd", "fused_adam",
                                  "adam_fused"])
def test_overlapped_step_waits_on_nothing_but_the_engine(name, monkeypatch, splitter):
    """Between updates, the overlapped step must not wait for a device: no host read of a
    tensor, no stream/event/device synchronize.  With CUDA gradients each parameter's update
    is then issued as soon as the engine reports its reduction done, ordered after it by the
    stream wait that synchronize() records (aiak_training.torch.cuda.consume), not by the
    host.  The optimizer's own step is excluded: it does the same in the synchronous path."""
    from aiak_training.common.gpu import cudart
    make = OPTIMIZERS[name] if name in OPTIMIZERS else VARIANTS[name][0]
    calls, inside = [], [0]

    def counter(label, fn):
        def counted(*args, **kwargs):
            if not inside[0]:
                calls.append(label)
            return fn(*args, **kwargs)
        return counted
    for attr in HOST_READS:
        monkeypatch.setattr(torch.Tensor, attr, counter(attr, getattr(torch.Tensor, attr)))
    for owner, attr in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                        (torch.cuda.Stream, "synchronize"),
                        (cudart.Runtime, "stream_synchronize"),
                        (cudart.Runtime, "event_synchronize")):
        if hasattr(owner, attr):
            monkeypatch.setattr(owner, attr, counter(attr, getattr(owner, attr)))
    real_update = ov.Overlap._update_subset
    updates = []

    def update(groups, index, params, updated, base_step):
        inside[0] += 1
        try:
            updates.append(len(params))
            return real_update(groups, index, params, updated, base_step)
        finally:
            inside[0] -= 1
    monkeypatch.setattr(ov.Overlap, "_update_subset", staticmethod(update))
    # Count only inside step(): backward and the loss are the user's.
    real_step = ov.Overlap.step
    active = []

    def step(self, opt, base_step):
        active.append(len(calls))
        real_step(self, opt, base_step)
        active.append(len(calls))
    monkeypatch.setattr(ov.Overlap, "step", step)
    model, opt = train(make, overlap=True, steps=6, splitter=splitter)
    if hvd.size() > 1:
        assert opt.overlap_stats()["overlapped_steps"] == 6
        assert len(updates) > 6  # several partial updates per step
    in_steps = [calls[a:b] for a, b in zip(active[::2], active[1::2])]
    assert all(c == [] for c in in_steps), in_steps
