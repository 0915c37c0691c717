"""op=hvd.Adasum (torch) against the independent NumPy reference in adasum_reference.py.

Run per rank by tests/test_adasum.py at 2, 4 and 8 ranks, and at 3, where every Adasum call
must raise Horovod's error instead (each test checks that branch itself).
"""
import numpy as np
import pytest
import torch

import aiak_training.torch as hvd
from aiak_training.common import horovod_strings as hs
from adasum_reference import adasum_tree, coefficients

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def power_of_two() -> bool:
    n = hvd.size()
    return n & (n - 1) == 0


def rank_input(rank: int, shape, dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """A shared direction plus a per-rank one, so the dot products between ranks are neither
    0 nor |a||b| (both coefficients matter); rounded to ``dtype``."""
    n = int(np.prod(shape))
    shared = np.random.default_rng(seed).standard_normal(n)
    own = np.random.default_rng(1000 * seed + rank + 1).standard_normal(n)
    return torch.from_numpy(scale * (shared + 0.8 * own)).reshape(shape).to(dtype)


def everyone(shape, dtype, seed=0, scale=1.0):
    return [rank_input(r, shape, dtype, seed, scale) for r in range(hvd.size())]


def check(result: torch.Tensor, inputs, dtype) -> None:
    """``result`` equals the reference within the derived bound, element by element."""
    expected, bound = adasum_tree([t.double().numpy() for t in inputs], str(dtype)[6:])
    got = result.double().numpy().ravel()
    assert result.dtype == dtype and result.shape == inputs[0].shape
    err = np.abs(got - expected)
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), (f"element {worst}: got {got[worst]!r}, expected "
                                  f"{expected[worst]!r} +- {bound[worst]:.3g}")


def expect_power_of_two_error():
    return pytest.raises(NotImplementedError, match="non-power of 2 ranks")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(1000,), (3, 5), (1,)])
def test_allreduce_matches_reference(dtype, shape):
    inputs = everyone(shape, dtype, seed=len(shape))
    mine = inputs[hvd.rank()]
    if not power_of_two():
        with expect_power_of_two_error():
            hvd.allreduce(mine, op=hvd.Adasum)
        return
    out = hvd.allreduce(mine, op=hvd.Adasum, name=f"adasum.{dtype}.{shape}")
    check(out, inputs, dtype)
    assert torch.equal(mine, inputs[hvd.rank()])  # out of place: the input is untouched


def test_async_and_in_place_forms():
    inputs = everyone((257,), torch.float32, seed=3)
    if not power_of_two():
        with expect_power_of_two_error():
            hvd.allreduce_async_(inputs[hvd.rank()].clone(), op=hvd.Adasum)
        return
    h = hvd.allreduce_async(inputs[hvd.rank()], op=hvd.Adasum, name="async")
    check(hvd.synchronize(h), inputs, torch.float32)
    t = inputs[hvd.rank()].clone()
    h = hvd.allreduce_async_(t, op=hvd.Adasum, name="async_")
    assert hvd.synchronize(h) is t
    check(t, inputs, torch.float32)
    t = inputs[hvd.rank()].clone()
    hvd.allreduce_(t, op=hvd.Adasum, name="inplace")
    check(t, inputs, torch.float32)


def test_large_tensor_takes_the_in_place_path():
    # Over AIAK_ZERO_COPY_BYTES (1 MiB): reduced in the tensor's own memory, unfused.
    inputs = everyone((300_001,), torch.float32, seed=4)
    if not power_of_two():
        with expect_power_of_two_error():
            hvd.allreduce(inputs[hvd.rank()], op=hvd.Adasum)
        return
    check(hvd.allreduce(inputs[hvd.rank()], op=hvd.Adasum, name="large"), inputs, torch.float32)


def test_grouped_allreduce_uses_per_tensor_coefficients():
    # Small tensors of different scales and directions: the engine fuses them into one
    # buffer, and each must still get its own coefficients.
    shapes, scales = [(5,), (300,), (4, 4), (1,)], [1.0, 1e-2, 30.0, 2.0]
    groups = [everyone(s, torch.float32, seed=10 + i, scale=c)
              for i, (s, c) in enumerate(zip(shapes, scales))]
    mine = [g[hvd.rank()] for g in groups]
    if not power_of_two():
        with expect_power_of_two_error():
            hvd.grouped_allreduce(mine, op=hvd.Adasum)
        return
    outs = hvd.grouped_allreduce(mine, op=hvd.Adasum, name="group")
    for out, inputs in zip(outs, groups):
        check(out, inputs, torch.float32)
    in_place = [t.clone() for t in mine]
    hvd.synchronize(hvd.grouped_allreduce_async_(in_place, op=hvd.Adasum, name="group_"))
    for out, inputs in zip(in_place, groups):
        check(out, inputs, torch.float32)
    if hvd.size() > 1:
        # The test can tell: coefficients taken over the whole buffer give another answer.
        flat = [np.concatenate([g[r].double().numpy().ravel() for g in groups])
                for r in range(hvd.size())]
        whole, _ = adasum_tree(flat)
        got = np.concatenate([o.double().numpy().ravel() for o in outs])
        assert np.max(np.abs(whole - got)) > 1e-3


def test_orthogonal_inputs_add_and_identical_inputs_average():
    n = hvd.size()
    # Rank r contributes (r + 1) at position r only: pairwise orthogonal, so a.b = 0, both
    # coefficients are 1, and the result is exactly the sum.
    ortho = torch.zeros(max(n, 2), dtype=torch.float32)
    ortho[hvd.rank()] = hvd.rank() + 1.0
    same = torch.linspace(-1.0, 2.0, 33, dtype=torch.float32)
    if not power_of_two():
        with expect_power_of_two_error():
            hvd.allreduce(ortho, op=hvd.Adasum)
        return
    expected = torch.zeros_like(ortho)
    expected[:n] = torch.arange(1, n + 1, dtype=torch.float32)
    assert torch.equal(hvd.allreduce(ortho, op=hvd.Adasum, name="ortho"), expected)
    # Identical inputs: a.b = |a|^2 = |b|^2, both coefficients are 1/2: the average, a itself.
    assert torch.equal(hvd.allreduce(same, op=hvd.Adasum, name="same"), same)


def test_scale_factors_apply_around_adasum():
    inputs = everyone((64,), torch.float64, seed=5)
    if not power_of_two():
        with expect_power_of_two_error():
            hvd.allreduce(inputs[hvd.rank()], op=hvd.Adasum, prescale_factor=0.5)
        return
    out = hvd.allreduce(inputs[hvd.rank()], op=hvd.Adasum, prescale_factor=0.5,
                        postscale_factor=3.0, name="scaled")
    expected, bound = adasum_tree([0.5 * t.numpy() for t in inputs])
    np.testing.assert_allclose(out.numpy(), 3.0 * expected, rtol=0, atol=3.0 * bound.max())


def test_bad_input_is_refused_with_a_clear_error():
    for dtype in (torch.int32, torch.int64, torch.uint8, torch.bool):
        with pytest.raises(ValueError, match=str(dtype)):
            hvd.allreduce(torch.ones(4, dtype=dtype), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="reducescatter"):
        hvd.reducescatter(torch.ones(4, 2), op=hvd.Adasum)
    if hvd.size() > 1:
        ps = hvd.add_process_set([0])
        try:
            with pytest.raises(NotImplementedError, match=hs.ADASUM_PROCESS_SETS):
                hvd.allreduce(torch.ones(3), op=hvd.Adasum, process_set=ps)
        finally:
            hvd.remove_process_set(ps)


# ---- DistributedOptimizer(op=Adasum): the delta optimizer -------------------------------------
def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3, dtype=torch.float64))


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(50_000 + 1000 * step + 10 * micro + rank)
    return (torch.randn(5, 6, generator=g, dtype=torch.float64),
            torch.randn(5, 3, generator=g, dtype=torch.float64))


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def reference_training(make_opt, steps, passes):
    """Every rank simulated here: each steps its own copy of the optimizer on its own data,
    from the shared parameters, and the parameters move by the Adasum of the updates, per
    parameter tensor."""
    shared = [p.detach().clone() for p in make_model().parameters()]
    sims = [make_model() for _ in range(hvd.size())]
    opts = [make_opt(m.parameters()) for m in sims]
    for step in range(steps):
        deltas = []
        for r, (sim, opt) in enumerate(zip(sims, opts)):
            with torch.no_grad():
                for p, s in zip(sim.parameters(), shared):
                    p.copy_(s)
            opt.zero_grad()
            for micro in range(passes):
                loss_fn(sim, *batch(r, step, micro)).backward()
            opt.step()
            deltas.append([(p.detach() - s).numpy() for p, s in zip(sim.parameters(), shared)])
        for i, s in enumerate(shared):
            combined, _ = adasum_tree([d[i] for d in deltas])
            s += torch.from_numpy(combined.reshape(s.shape))
    return shared


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_distributed_optimizer_reduces_the_update(name, passes):
    model = make_model()
    opt = OPTIMIZERS[name](model.parameters())
    if hvd.size() > 1 and not power_of_two():
        with expect_power_of_two_error():
            dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            op=hvd.Adasum)
            loss_fn(model, *batch(hvd.rank(), 0, 0)).backward()
            dist.step()
        return
    dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    op=hvd.Adasum, backward_passes_per_step=passes)
    assert isinstance(dist, type(opt))
    for step in range(3):
        dist.zero_grad()
        for micro in range(passes):
            loss_fn(model, *batch(hvd.rank(), step, micro)).backward()
        dist.step()
    expected = reference_training(OPTIMIZERS[name], 3, passes)
    for p, e in zip(model.parameters(), expected):
        # float64 throughout; the two sides differ only in float64 summation order (~1e-16
        # relative per operation), far below the 1e-12 allowed here.
        np.testing.assert_allclose(p.detach().numpy(), e.numpy(), rtol=1e-12, atol=1e-14)
    if hvd.size() > 1:
        with pytest.raises(AssertionError, match="skip_synchronize"):
            with dist.skip_synchronize():
                pass


def test_coefficients_of_the_reference_follow_the_paper():
    # The reference itself, on cases solved by hand: orthogonal -> (1, 1); equal -> (1/2,
    # 1/2); b = 2a -> a.b = 2|a|^2: ca = 0, cb = 1 - 2|a|^2 / (2 * 4|a|^2) = 3/4.
    a = np.array([1.0, 2.0, 0.0])
    assert coefficients(a, np.array([0.0, 0.0, 5.0])) == (1.0, 1.0)
    assert coefficients(a, a) == (0.5, 0.5)
    assert coefficients(a, 2 * a) == (0.0, 0.75)
