"""DistributedOptimizer(shard_optimizer_state=True) against the dense DistributedOptimizer and
against a reference computed here from every rank's data (issue 32).

Run by tests/test_sharded_optimizer.py on 2 and 4 ranks, a 2x2 layout, and over Gloo, with a
small AIAK_SHARD_BUCKET_BYTES so that there are several buckets and shards cut through
parameters.  At 2 ranks the sharded and dense runs are compared bit for bit: a two-term sum is
the same whichever collective computes it; with more ranks the reduce-scatter and the
allreduce may add in different orders, so the check is 1e-6 relative.  FusedLAMB's norms are
summed over the shards in another order than the dense kernel's, and its sharded update runs
torch ops instead of the CPU kernel, so it is compared at 1e-6 relative on every layout.

AIAK_SHARDED_TEST_STEPS changes the number of steps of the exactness tests (12 by default; the
docs quote a run with 100).
"""
import math
import os

import pytest
import torch

import aiak_training.torch as hvd
from aiak_training.fused_optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD
from aiak_training.torch.optim import sharded

STEPS = int(os.environ.get("AIAK_SHARDED_TEST_STEPS", "12"))


class Net(torch.nn.Module):
    """Two param groups' worth of layers, a frozen layer, and a block no rank uses on odd
    steps (its gradient is missing, and reduced as zeros)."""

    def __init__(self, double_head: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 9)
        self.b = torch.nn.Linear(9, 7)
        self.unused = torch.nn.Linear(7, 7)
        self.frozen = torch.nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(7, 3)
        if double_head:
            self.head = self.head.double()

    def forward(self, x, step):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if step % 2 == 0:
            h = h + self.unused(h)
        h = self.frozen(h)
        return self.head(h.to(self.head.weight.dtype))


def batch(step, r):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def loss_of(model, step, r):
    x, y = batch(step, r)
    return (model(x, step) - y.to(model.head.weight.dtype)).pow(2).mean()


def param_groups(model, lr):
    return [{"params": list(model.a.parameters()) + list(model.frozen.parameters())},
            {"params": [p for n, p in model.named_parameters()
                        if not n.startswith(("a.", "frozen."))], "lr": lr * 0.5}]


OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(param_groups(m, 0.05), lr=0.05, momentum=0.9,
                                              weight_decay=1e-3),
    "adam": lambda m: torch.optim.Adam(param_groups(m, 0.01), lr=0.01),
    "adamw": lambda m: torch.optim.AdamW(param_groups(m, 0.01), lr=0.01, weight_decay=0.1),
    "fused_sgd": lambda m: FusedSGD(param_groups(m, 0.05), lr=0.05, momentum=0.9,
                                    nesterov=True),
    "fused_adam": lambda m: FusedAdam(param_groups(m, 0.01), lr=0.01),
    "fused_adamw": lambda m: FusedAdamW(param_groups(m, 0.01), lr=0.01, weight_decay=0.1),
    # Decoupled weight decay (trust ratio on), global clipping active (the gradients' norm is
    # above 0.05 at every step).
    "fused_lamb": lambda m: FusedLAMB(param_groups(m, 0.01), lr=0.01, weight_decay=0.01,
                                      max_grad_norm=0.05),
    # L2 mode, NVLAMB (trust ratio without weight decay in the second group), no clipping.
    "fused_lamb_l2": lambda m: FusedLAMB(
        [{"params": list(m.a.parameters()) + list(m.frozen.parameters())},
         {"params": [p for n, p in m.named_parameters() if not n.startswith(("a.", "frozen."))],
          "weight_decay": 0.0}],
        lr=0.02, weight_decay=0.05, adam_w_mode=False, use_nvlamb=True, max_grad_norm=None),
}
# Compared at 1e-6 relative on every layout (module docstring).
NOT_BITWISE = {"fused_lamb", "fused_lamb_l2"}


def train(model, opt, steps=STEPS, passes=1, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        for k in range(passes):
            loss_of(model, step * passes + k, hvd.rank()).backward()
        opt.step()


def flat(model):
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def reference(kind, op, passes, steps=STEPS, double_head=False):
    """The plain optimizer on gradients reduced here from every rank's data."""
    model = Net(double_head)
    opt = OPTIMIZERS[kind](model)
    n = hvd.size()
    for step in range(steps):
        grads = None
        for r in range(n):
            model.zero_grad()
            for k in range(passes):
                loss_of(model, step * passes + k, r).backward()
            # A missing gradient is reduced as zeros; on one rank (the plain optimizer) it
            # stays missing and the parameter is not stepped.
            g = [p.grad.clone() if p.grad is not None else None if n == 1
                 else torch.zeros_like(p) for p in model.parameters()]
            grads = g if grads is None else [x + y for x, y in zip(grads, g)]
        for p, g in zip(model.parameters(), grads):
            p.grad = None if not p.requires_grad or g is None else \
                (g / n if op == hvd.Average else g)
        opt.step()
    return model, opt


def assert_same(a, b, exact):
    if exact:
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def exact_layout(kind=None):
    return hvd.size() == 2 and kind not in NOT_BITWISE


def make(kind, shard, op=hvd.Average, passes=1, double_head=False, **kw):
    model = Net(double_head)
    opt = hvd.DistributedOptimizer(OPTIMIZERS[kind](model),
                                   named_parameters=model.named_parameters(), op=op,
                                   backward_passes_per_step=passes,
                                   shard_optimizer_state=shard, **kw)
    return model, opt


@pytest.fixture(params=sharded.GRADIENT_MODES)
def grads(request, monkeypatch):
    """Each gradient storage mode of the sharded optimizer (AIAK_SHARD_GRADIENTS)."""
    monkeypatch.setenv(sharded.GRADIENTS_ENV_VAR, request.param)
    return request.param


# ---- exactness ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_parameters_equal_dense_run(kind, grads):
    dense, dopt = make(kind, False)
    train(dense, dopt)
    model, opt = make(kind, True)
    train(model, opt)
    assert_same(flat(model), flat(dense), exact_layout(kind))
    ref, _ = reference(kind, hvd.Average, 1)
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op,passes", [(hvd.Sum, 1), (hvd.Average, 2), (hvd.Sum, 3)])
def test_sum_and_backward_passes(op, passes, grads):
    dense, dopt = make("adam", False, op=op, passes=passes)
    train(dense, dopt, steps=6, passes=passes)
    model, opt = make("adam", True, op=op, passes=passes)
    train(model, opt, steps=6, passes=passes)
    assert_same(flat(model), flat(dense), exact_layout())
    ref, _ = reference("adam", op, passes, steps=6)
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-5, atol=1e-6)


def test_predivide_factor():
    dense, dopt = make("sgd_momentum", False, gradient_predivide_factor=2.0)
    train(dense, dopt, steps=5)
    model, opt = make("sgd_momentum", True, gradient_predivide_factor=2.0)
    train(model, opt, steps=5)
    torch.testing.assert_close(flat(model), flat(dense), rtol=1e-6, atol=1e-7)


def test_mixed_dtypes_get_their_own_buckets():
    dense, dopt = make("adam", False, double_head=True)
    train(dense, dopt, steps=5)
    model, opt = make("adam", True, double_head=True)
    train(model, opt, steps=5)
    assert {b.storage.dtype for b in opt._buckets} == {torch.float32, torch.float64}
    assert all(len({p.dtype for p in b.params}) == 1 for b in opt._buckets)
    assert_same(flat(model), flat(dense), exact_layout())


def test_gradient_clipping_by_global_norm():
    max_norm = 0.05
    dense, dopt = make("adam", False)
    model, opt = make("adam", True)
    for step in range(5):
        for m, o in ((dense, dopt), (model, opt)):
            o.zero_grad()
            loss_of(m, step, hvd.rank()).backward()
            o.synchronize()
        total_dense = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
        total = opt.clip_grad_norm_(max_norm)
        torch.testing.assert_close(total, total_dense, rtol=1e-5, atol=1e-7)
        for o in (dopt, opt):
            with o.skip_synchronize():
                o.step()
    torch.testing.assert_close(flat(model), flat(dense), rtol=1e-5, atol=1e-6)


def test_lamb_norms_are_one_batched_allreduce_per_step(monkeypatch):
    from aiak_training.torch.optim.sharded import step as sharded_step
    calls = []
    real = sharded_step.allreduce

    def counting(tensor, *args, **kwargs):
        calls.append((kwargs.get("name"), tuple(tensor.shape)))
        return real(tensor, *args, **kwargs)
    monkeypatch.setattr(sharded_step, "allreduce", counting)
    for kind, expected in (("fused_lamb", 2), ("fused_lamb_l2", 1)):
        model, opt = make(kind, True)
        calls.clear()
        train(model, opt, steps=1)
        # The clip norm (when clipping) and one table of every sharded parameter's norms.
        assert len(calls) == expected, calls
        sharded_params = sum(len(b.params) for b in opt._buckets)
        assert calls[-1] == ("sharded.lamb.norms", (sharded_params, 2))


# ---- the allgather overlapping the next forward pass -----------------------------------------
@pytest.mark.parametrize("kind", ["sgd_momentum", "adam", "fused_lamb"])
def test_overlapped_allgather_equals_waiting_step(kind):
    plain, popt = make(kind, True)
    model, opt = make(kind, True)
    opt.overlap_allgather(model)
    in_flight = []
    for step in range(6):
        for m, o in ((plain, popt), (model, opt)):
            o.zero_grad()
            loss_of(m, step, hvd.rank()).backward()
            o.step()
        in_flight.append((len(opt._gathers), len(opt._pending_gathers())))
        assert not popt._pending_gathers()
    # step() returned with every bucket's allgather started and pending: the overlap really
    # happened.
    assert len(opt._buckets) > 2
    assert in_flight == [(len(opt._buckets), len(opt._buckets))] * 6
    loss_of(model, 6, hvd.rank())  # the forward waits for the buckets of the modules it runs
    unused = {opt._bucket_of[p] for p in model.unused.parameters()}
    used = {opt._bucket_of[p] for n, p in model.named_parameters()
            if p.requires_grad and not n.startswith("unused.")}
    assert set(opt._pending_gathers()) <= unused - used  # odd step: the unused block did not run
    opt.wait_for_parameters()
    assert torch.equal(flat(model), flat(plain))


def test_parameters_read_after_step_are_up_to_date():
    plain, popt = make("adam", True)
    train(plain, popt, steps=3)
    want = {k: v.clone() for k, v in plain.state_dict().items()}
    readers = {
        "model.state_dict": lambda m, o: {k: v.clone() for k, v in m.state_dict().items()},
        "wait_for_parameters": lambda m, o: (o.wait_for_parameters(),
                                             {k: v.clone() for k, v in
                                              m.named_parameters()})[1],
        "broadcast_parameters": lambda m, o: (hvd.broadcast_parameters(
            list(m.named_parameters()), root_rank=0),
            {k: v.clone() for k, v in m.named_parameters()})[1],
        "zero_grad": lambda m, o: (o.zero_grad(), dict(m.named_parameters()))[1],
        "consolidate_state_dict": lambda m, o: (o.consolidate_state_dict(),
                                                dict(m.named_parameters()))[1],
    }
    for what, read in readers.items():
        model, opt = make("adam", True)
        opt.overlap_allgather(model)
        train(model, opt, steps=3)
        assert opt._gathers, what
        got = read(model, opt)
        assert not opt._gathers, what
        for k, v in got.items():
            assert torch.equal(v, want[k]), (what, k)


def test_load_state_dict_is_not_overwritten_by_a_late_allgather():
    ref, _ = reference("adam", hvd.Average, 1, steps=2)
    model, opt = make("adam", True)
    opt.overlap_allgather(model)
    train(model, opt, steps=1)
    assert opt._gathers
    model.load_state_dict(ref.state_dict())
    assert not opt._gathers
    assert torch.equal(flat(model), flat(ref))


def test_forward_reading_another_modules_parameter_is_caught():
    class Reader(torch.nn.Module):
        """Uses its child's weight directly, so the child's forward hook never runs."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.child = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.child.weight, self.child.bias)

    model = Reader()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   shard_optimizer_state=True)
    opt.overlap_allgather(model)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="wait_for_parameters"):
        model(torch.ones(2, 4)).sum().backward()
    assert not opt._gathers  # the model was left with the updated values
    assert not opt._handles  # one bucket: nothing was started before the error
    # The documented fix: wait before such a forward.
    opt.zero_grad()
    opt.wait_for_parameters()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()


def test_overlap_allgather_off_again_and_bad_model():
    model, opt = make("sgd_momentum", True)
    with pytest.raises(ValueError, match="owns none"):
        opt.overlap_allgather(torch.nn.Linear(2, 2))
    opt.overlap_allgather(model)
    opt.overlap_allgather(None)
    train(model, opt, steps=1)
    assert not opt._gathers


# ---- memory: the state exists for the shard only ---------------------------------------------
def test_transient_buffers_are_bounded_and_reused():
    model, opt = make("adam", True)
    assert len(opt._buckets) > sharded.REDUCES_IN_FLIGHT
    cached = []
    for step in range(4):
        opt.zero_grad()
        loss_of(model, step, hvd.rank()).backward()
        # Backward freed the full gradients of every bucket it started (a bucket with a
        # parameter unused this step starts in step()) and holds at most REDUCES_IN_FLIGHT
        # flat copies.
        started = [b for b, (handle, _) in opt._handles.items() if handle is not None]
        assert len(started) > sharded.REDUCES_IN_FLIGHT
        # Every gradient was copied into its bucket's buffer and freed as soon as autograd
        # had accumulated it, in started buckets and in the one left for step() alike.
        assert all(p.grad is None for p in opt._bucket_of)
        assert any(b.staging is not None and b.staged for b in opt._buckets
                   if b not in started) == (step % 2 == 1)
        running = [b for b, (_, flat) in opt._handles.items() if flat is not None]
        assert len(running) <= sharded.REDUCES_IN_FLIGHT
        opt.step()
        cached.append(sorted(id(b) for b in opt._buffers.buffers()))
    # A few buffers serve every bucket of every step: a step allocates one only when more
    # were in use at once than ever before (how many depends on when reduce-scatters finish),
    # and none is dropped.
    assert 0 < len(cached[0]) and len(cached[-1]) < len(opt._buckets)
    for before, after in zip(cached, cached[1:]):
        assert set(before) <= set(after)
def test_state_is_one_shard():
    model, opt = make("adam", True)
    train(model, opt, steps=2)
    mine = sum(s["exp_avg"].numel() for s in opt.state.values())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    everyone = hvd.allgather(torch.tensor([mine])).tolist()
    assert sum(everyone) == trainable  # every element's moments exist exactly once
    # Buckets are padded to a multiple of N: no rank holds more than its share plus N - 1
    # elements per bucket.
    share = math.ceil(trainable / hvd.size()) + len(opt._buckets) * (hvd.size() - 1)
    assert mine <= share
    assert all(p not in opt.state for p in model.parameters())
    # The model's full gradients are freed once reduced (the default, bounded gradients).
    assert all(p.grad is None for p in model.parameters())


# ---- flat parameter storage ------------------------------------------------------------------
def views_of_buckets(opt):
    """Whether every sharded parameter's storage is its slice of its bucket's flat buffer."""
    return all(p.data_ptr() == b.storage[off:].data_ptr() and p.is_contiguous()
               for b in opt._buckets for p, off in zip(b.params, b.offsets))


def test_parameters_are_views_of_the_flat_buckets():
    dense, dopt = make("adam", False)
    model, opt = make("adam", True)
    assert views_of_buckets(opt)
    # Building the optimizer kept the values, and the allgather writes the parameters in
    # place: they stay views, step after step.
    assert torch.equal(flat(model), flat(Net()))
    train(model, opt, steps=3)
    train(dense, dopt, steps=3)
    assert views_of_buckets(opt)
    assert_same(flat(model), flat(dense), exact_layout())


def test_views_survive_to_load_broadcast_and_checkpoint():
    import io
    ref, _ = reference("adam", hvd.Average, 1, steps=2)
    model, opt = make("adam", True)
    train(model, opt, steps=1)
    model.to(torch.float32)  # a no-op conversion keeps the storage
    model.load_state_dict(ref.state_dict())  # copies into the parameters in place
    assert views_of_buckets(opt)
    assert torch.equal(flat(model), flat(ref))
    for p in model.parameters():  # rank 0's values everywhere
        p.data.add_(float(hvd.rank()))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert views_of_buckets(opt)
    assert torch.equal(flat(model), flat(ref))
    # A checkpoint of the model round-trips, and the optimizer trains on the loaded values:
    # the run equals a dense one resumed from the same weights.
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()))
    assert all(torch.equal(saved[k], v) for k, v in ref.state_dict().items())
    resumed, ropt = make("adam", True)
    resumed.load_state_dict(saved)
    dense, dopt = make("adam", False)
    dense.load_state_dict(saved)
    train(resumed, ropt, steps=3, start=2)
    train(dense, dopt, steps=3, start=2)
    assert views_of_buckets(ropt)
    assert_same(flat(resumed), flat(dense), exact_layout())


def test_replaced_parameter_data_is_taken_back_into_its_bucket():
    model, opt = make("sgd_momentum", True)
    dense, dopt = make("sgd_momentum", False)
    train(model, opt, steps=1)
    train(dense, dopt, steps=1)
    # `p.data = t` detaches the parameter from the bucket; the next step takes its value.
    with torch.no_grad():
        for m in (model, dense):
            m.b.weight.data = m.b.weight.detach().clone() * 0.5
    assert not views_of_buckets(opt)
    train(model, opt, steps=2, start=1)
    train(dense, dopt, steps=2, start=1)
    assert views_of_buckets(opt)
    assert_same(flat(model), flat(dense), exact_layout())


def test_kept_gradients_are_views_reduced_in_place(grads):
    model, opt = make("adam", True)
    dense, dopt = make("adam", False)
    assert all((b.grad_buffer is not None) == (grads == "kept") for b in opt._buckets)
    without_grad = set(opt._bucket_of)  # parameters whose p.grad is None before zero_grad
    for step in range(4):
        # zero_grad() (set_to_none) leaves p.grad None, as torch does; set_to_none=False keeps
        # the gradient buffer's views, which the next backward accumulates into in place.  (On
        # one rank, bounded gradients are None after a step, so the plain optimizer's zero
        # gradient of the block unused on odd steps is missing there: the docs' Limits.)
        to_none = step < 2 or (grads == "bounded" and hvd.size() == 1)
        for o in (opt, dopt):
            o.zero_grad(set_to_none=to_none)
        assert all((p.grad is None) == (to_none or grads == "bounded" or p in without_grad)
                   for p in opt._bucket_of)
        for m, o in ((model, opt), (dense, dopt)):
            loss_of(m, step, hvd.rank()).backward()
            o.synchronize()
        for b in opt._buckets:
            for p, off in zip(b.params, b.offsets):
                if grads == "kept" and p not in b.missing:
                    # This rank's own gradient, in the bucket's buffer.
                    assert p.grad.data_ptr() == b.grad_buffer[off:].data_ptr()
                else:  # freed once reduced; a missing gradient stays missing, as in dense
                    assert p.grad is None
        without_grad = {p for p in opt._bucket_of if p.grad is None}
        if step % 2:  # the block no rank used this step
            assert all(p in opt._bucket_of[p].missing for p in model.unused.parameters()) \
                == (to_none or grads == "bounded")
        for o in (opt, dopt):
            with o.skip_synchronize():
                o.step()
    assert_same(flat(model), flat(dense), exact_layout())


def test_gradient_mode_from_environment_is_checked(monkeypatch):
    monkeypatch.setenv(sharded.GRADIENTS_ENV_VAR, "sideways")
    with pytest.raises(ValueError, match="AIAK_SHARD_GRADIENTS='sideways'.*bounded, kept, flat"):
        make("adam", True)


def test_gradient_mode_accepts_its_older_name(monkeypatch):
    monkeypatch.setenv(sharded.GRADIENTS_ENV_VAR, "FLAT")
    _, opt = make("adam", True)
    assert all(b.grad_buffer is not None for b in opt._buckets)
    monkeypatch.setenv(sharded.GRADIENTS_ENV_VAR, "bounded")
    _, opt = make("adam", True)
    assert all(b.grad_buffer is None for b in opt._buckets)


def test_parameter_converted_after_building_names_it():
    model, opt = make("adam", True)
    opt.zero_grad()
    loss_of(model, 0, hvd.rank()).backward()
    model.a.double()  # a new tensor of another dtype: it can no longer live in the bucket
    with pytest.raises(ValueError, match=r"parameter a\.(weight|bias) changed .*model\.to\(\)"):
        opt.step()


# ---- checkpoints -----------------------------------------------------------------------------
def test_state_dict_needs_consolidation_and_never_communicates():
    model, opt = make("adam", True)
    train(model, opt, steps=2)
    if hvd.rank() == 0:  # rank 0 alone: must raise, not wait for the others
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            opt.state_dict()
    full = opt.consolidate_state_dict()
    assert opt.state_dict() is full
    train(model, opt, steps=1, start=2)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam", "fused_adamw", "fused_lamb"])
def test_consolidated_state_equals_dense_state(kind):
    dense, dopt = make(kind, False)
    train(dense, dopt, steps=4)
    model, opt = make(kind, True)
    train(model, opt, steps=4)
    got, want = opt.consolidate_state_dict(), dopt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, entry in want["state"].items():
        assert sorted(got["state"][i]) == sorted(entry)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert_same(got["state"][i][key].double(), value.double(),
                            exact_layout(kind))
            else:
                assert got["state"][i][key] == value


def test_full_state_dict_loads_into_sharded_and_plain_optimizers():
    # A checkpoint written by a plain optimizer (world size 1), resumed sharded over N ranks.
    ref, ref_opt = reference("adam", hvd.Average, 1, steps=4)
    model, opt = make("adam", True)
    model.load_state_dict(ref.state_dict())
    opt.load_state_dict(ref_opt.state_dict())
    train(model, opt, steps=3, start=4)
    dense, dopt = make("adam", False)
    dense.load_state_dict(ref.state_dict())
    dopt.load_state_dict(ref_opt.state_dict())
    train(dense, dopt, steps=3, start=4)
    assert_same(flat(model), flat(dense), exact_layout())
    # ...and the sharded optimizer's consolidated state loads into a plain one.
    full = opt.consolidate_state_dict()
    plain = torch.optim.Adam(param_groups(Net(), 0.01), lr=0.01)
    plain.load_state_dict(full)
    got = plain.state_dict()["state"]
    for i, entry in dopt.state_dict()["state"].items():
        assert_same(got[i]["exp_avg_sq"], entry["exp_avg_sq"], exact_layout())


def test_state_dict_of_another_model_gives_the_plain_error():
    _, opt = make("adam", True)
    other = torch.optim.Adam(torch.nn.Linear(3, 3).parameters(), lr=0.1)
    plain = torch.optim.Adam(param_groups(Net(), 0.01), lr=0.01)
    with pytest.raises(ValueError) as want:
        plain.load_state_dict(other.state_dict())
    with pytest.raises(ValueError) as got:
        opt.load_state_dict(other.state_dict())
    assert str(got.value) == str(want.value)


def test_optimizer_state_carried_over_when_wrapping():
    ref, ref_opt = reference("sgd_momentum", hvd.Average, 1, steps=3)
    model = Net()
    model.load_state_dict(ref.state_dict())
    inner = OPTIMIZERS["sgd_momentum"](model)
    inner.load_state_dict(ref_opt.state_dict())
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   shard_optimizer_state=True)
    dense = Net()
    dense.load_state_dict(ref.state_dict())
    dinner = OPTIMIZERS["sgd_momentum"](dense)
    dinner.load_state_dict(ref_opt.state_dict())
    dopt = hvd.DistributedOptimizer(dinner, named_parameters=dense.named_parameters())
    train(model, opt, steps=2, start=3)
    train(dense, dopt, steps=2, start=3)
    assert_same(flat(model), flat(dense), exact_layout())


def test_broadcast_optimizer_state_broadcasts_options():
    model, opt = make("adam", True)
    train(model, opt, steps=1)
    before = {id(k): v["exp_avg"].clone() for k, v in opt.state.items()}
    for g in opt.param_groups:
        g["lr"] = 0.125 if hvd.rank() == 0 else 7.0
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert [g["lr"] for g in opt.param_groups] == [0.125, 0.125]
    assert all(torch.equal(v["exp_avg"], before[id(k)]) for k, v in opt.state.items())


# ---- bad input -------------------------------------------------------------------------------
def test_unknown_optimizer_refused_at_construction():
    model = Net()
    for inner in (torch.optim.LBFGS(model.parameters()),):
        with pytest.raises(ValueError, match=f"{type(inner).__name__} is not an optimizer known"):
            hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                     shard_optimizer_state=True)

    class MyAdam(torch.optim.Adam):
        pass
    with pytest.raises(ValueError, match="MyAdam"):
        hvd.DistributedOptimizer(MyAdam(model.parameters()),
                                 named_parameters=model.named_parameters(),
                                 shard_optimizer_state=True)


@pytest.mark.parametrize("kwargs,word", [
    ({"compression": hvd.Compression.fp16}, "compression"),
    ({"op": hvd.Adasum}, "Adasum"),
    ({"groups": 2}, "groups"),
    ({"sparse_as_dense": True}, "sparse_as_dense"),
    ({"overlap_update": True}, "overlap_update")])
def test_unsupported_combinations_refused(kwargs, word):
    model = Net()
    with pytest.raises(ValueError, match=word):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(),
                                 shard_optimizer_state=True, **kwargs)


def test_sparse_gradient_names_the_parameter():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=[("table", emb.weight)],
                                   shard_optimizer_state=True)
    with pytest.raises(ValueError, match="table.*sparse"):
        emb(torch.tensor([1, 2])).sum().backward()
    opt._handles.clear()


def test_elastic_torch_state_refuses_sharded_optimizer():
    model, opt = make("adam", True)
    with pytest.raises(ValueError, match="shard_optimizer_state"):
        hvd.elastic.TorchState(model=model, optimizer=opt)


def test_frozen_parameters_stay_out_of_the_shards():
    model, opt = make("sgd_momentum", True)
    frozen = {id(p) for p in model.frozen.parameters()}
    assert all(id(p) not in frozen for b in opt._buckets for p in b.params)
    before = [p.clone() for p in model.frozen.parameters()]
    train(model, opt, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.frozen.parameters()))


def test_bucket_size_from_environment():
    assert int(os.environ[sharded.BUCKET_ENV_VAR]) < 1024
    _, opt = make("adam", True)
    assert len(opt._buckets) > 3
