"""Cached launch plans of the fused optimizers (aiak_training/fused_optim/_plan.py).

Every case steps a fused optimizer whose plans are cached next to one whose cache is disabled
(each step gathers the group parameter by parameter, the path every step took before plans),
with the same events between steps, and requires bit-identical params and states.  The CUDA
branch (ctypes pointer arrays for the CUDA library) is driven with CPU tensors and a fake
library that runs the CPU kernels on the addresses it is given, so no GPU is needed.
"""
import contextlib
import ctypes
import sys

import pytest
import torch

import aiak_training.fused_optim as fo
from aiak_training.fused_optim import _backend as B
from aiak_training.fused_optim import _plan as P

pytestmark = pytest.mark.skipif(B.cpu_ext is None, reason="aiak_training.fused_optim._cpu not built")

SHAPES = [(33,), (5, 19), (2, 3, 4, 5), (1,), (70_001,)]


class NoCache(P.PlanCache):
    """A plan cache that never keeps anything: the unplanned path on every step."""

    def store(self, plan):
        pass


def make_pair(make, shapes=SHAPES, dtype=torch.float32, seed=0):
    """(cached optimizer, its params), (uncached optimizer, its params), same initial values."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    a = [p.clone().requires_grad_() for p in init]
    b = [p.clone().requires_grad_() for p in init]
    opt_a, opt_b = make(a), make(b)
    opt_b.__dict__["_aiak_plans"] = NoCache()
    return (opt_a, a), (opt_b, b)


def set_grads(pairs, seed, skip=()):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in pairs[0][1]]
    for _, params in pairs:
        for i, (p, gr) in enumerate(zip(params, grads)):
            p.grad = None if i in skip else gr.clone()


def assert_same(pairs):
    (opt_a, a), (opt_b, b) = pairs
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sorted(sa) == sorted(sb)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def step_both(pairs):
    for opt, _ in pairs:
        opt.step()


def plan_of(opt, index=0):
    plans = P.plans_of(opt)._plans
    found = [p for k, p in plans.items() if k[0] == index]
    return found[0] if len(found) == 1 else None


MAKERS = {
    "adam": lambda ps: fo.FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad": lambda ps: fo.FusedAdamW(ps, lr=1e-2, amsgrad=True),
    "sgd-momentum": lambda ps: fo.FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "sgd-nesterov": lambda ps: fo.FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd-plain": lambda ps: fo.FusedSGD(ps, lr=0.1),
    # Clipping active (the gradients' norm is far above 0.5), decoupled and L2 weight decay.
    "lamb": lambda ps: fo.FusedLAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=0.5),
    "lamb-l2-nvlamb": lambda ps: fo.FusedLAMB(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False,
                                              use_nvlamb=True, max_grad_norm=None),
}


# ------------------------------------------------------------------------ steady path
@pytest.mark.parametrize("name", list(MAKERS))
def test_plan_is_built_once_and_reused(name):
    pairs = make_pair(MAKERS[name])
    set_grads(pairs, 1)
    step_both(pairs)
    set_grads(pairs, 2)
    step_both(pairs)  # SGD with momentum caches its plan once the buffers exist
    plan = plan_of(pairs[0][0])
    assert plan is not None
    for s in range(3, 7):
        # set_to_none: new gradient tensors each step; only the gradient table changes
        set_grads(pairs, s)
        step_both(pairs)
        assert plan_of(pairs[0][0]) is plan
        assert_same(pairs)
    assert len(P.plans_of(pairs[1][0])) == 0


def _python_calls_in_step(opt):
    """Python function calls made by one step() (C calls are not counted)."""
    calls = []

    def prof(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)
    sys.setprofile(prof)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("name", ["adam", "sgd-momentum", "lamb"])
def test_steady_step_runs_no_python_per_parameter(name):
    """The number of Python calls in a cached step does not depend on the parameter count,
    also when every gradient is a new tensor (zero_grad(set_to_none=True))."""
    counts = []
    for n in (4, 64):
        params = [torch.randn(3, 5).requires_grad_() for _ in range(n)]
        opt = MAKERS[name](params)
        for s in range(4):
            for p in params:
                p.grad = torch.full_like(p, 0.01 * (s + 1))
            if s < 3:
                opt.step()
        calls = _python_calls_in_step(opt)
        counts.append(len(calls))
        assert not {"_init_group", "_unplanned_step", "_gather"} & set(calls), calls
    assert counts[0] == counts[1], counts


# --------------------------------------------------------------------------- invalidation
@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_param_data_swap_rebuilds_the_plan(name):
    pairs = make_pair(MAKERS[name])
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    plan = plan_of(pairs[0][0])
    for _, params in pairs:  # e.g. a checkpoint restored with param.data = loaded
        params[1].data = params[1].data.clone() * 0.5
    set_grads(pairs, 3)
    step_both(pairs)
    assert plan_of(pairs[0][0]) is not plan
    assert_same(pairs)


def test_load_state_dict_rebuilds_the_plan():
    pairs = make_pair(MAKERS["adamw-amsgrad"])
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    saved = pairs[1][0].state_dict()
    plan = plan_of(pairs[0][0])
    for opt, _ in pairs:  # its own doubled copy each: loading may keep the given tensors
        opt.load_state_dict({
            "state": {k: {n: t.clone() * 2 for n, t in v.items()} for k, v in saved["state"].items()},
            "param_groups": saved["param_groups"]})
    set_grads(pairs, 3)
    step_both(pairs)
    assert plan_of(pairs[0][0]) is not plan
    assert_same(pairs)
    # the loaded (doubled) states were used, not the old tensors
    (opt_a, a), _ = pairs
    assert float(opt_a.state[a[0]]["step"]) == 2 * 2 + 1


@pytest.mark.parametrize("name", ["adam", "lamb"])
@pytest.mark.parametrize("event", ["replace_tensor", "drop_param_state", "clear_state"])
def test_state_edits_rebuild_the_plan(event, name):
    pairs = make_pair(MAKERS[name])
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    plan = plan_of(pairs[0][0])
    for opt, params in pairs:
        if event == "replace_tensor":
            opt.state[params[2]]["exp_avg"] = torch.ones_like(params[2])
        elif event == "drop_param_state":
            del opt.state[params[0]]
        else:
            opt.state.clear()
    set_grads(pairs, 3)
    step_both(pairs)
    assert plan_of(pairs[0][0]) is not plan
    assert_same(pairs)


def test_hyperparameters_and_schedulers_reuse_the_plan():
    pairs = make_pair(MAKERS["adam"])
    scheds = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt, _ in pairs]
    for s in range(1, 6):
        set_grads(pairs, s)
        step_both(pairs)
        for sc in scheds:
            sc.step()
        for opt, _ in pairs:
            opt.param_groups[0]["betas"] = (0.8 + 0.01 * s, 0.99)
            opt.param_groups[0]["weight_decay"] = 0.01 * s
        if s == 2:
            plan = plan_of(pairs[0][0])
        if s > 2:
            assert plan_of(pairs[0][0]) is plan
    assert_same(pairs)


def test_amsgrad_switched_on_later_rebuilds_the_plan():
    pairs = make_pair(MAKERS["adam"])
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    for opt, _ in pairs:
        opt.param_groups[0]["amsgrad"] = True
    for s in (3, 4):
        set_grads(pairs, s)
        step_both(pairs)
    assert "max_exp_avg_sq" in pairs[0][0].state[pairs[0][1][0]]
    assert_same(pairs)


@pytest.mark.parametrize("name", ["adam", "sgd-momentum", "lamb"])
def test_gradients_appearing_and_disappearing(name):
    pairs = make_pair(MAKERS[name])
    pattern = [(), (), (1,), (1,), (), (0, 4), ()]
    for s, skip in enumerate(pattern):
        set_grads(pairs, s + 1, skip=skip)
        step_both(pairs)
        assert_same(pairs)


def test_non_contiguous_gradient_takes_the_reference_path_then_recovers():
    pairs = make_pair(MAKERS["adam"])
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    for _, params in pairs:  # a (5, 19) param given a transposed (non-contiguous) gradient
        params[1].grad = torch.full((19, 5), 0.25).t()
    step_both(pairs)
    assert not pairs[0][1][1].grad.is_contiguous()
    assert plan_of(pairs[0][0]) is None  # not plannable: the step went through fused_adam
    assert_same(pairs)
    set_grads(pairs, 4)
    step_both(pairs)
    assert plan_of(pairs[0][0]) is not None
    assert_same(pairs)


def test_zero_grad_in_place_keeps_the_gradient_table():
    pairs = make_pair(MAKERS["sgd-momentum"])
    set_grads(pairs, 1)
    for s in range(2, 6):
        step_both(pairs)
        for opt, params in pairs:
            opt.zero_grad(set_to_none=False)
            for p in params:
                p.grad.add_(0.1 * s)
    plan = plan_of(pairs[0][0])
    grads_table = plan.buckets[0].tables["grads"]
    step_both(pairs)
    assert plan_of(pairs[0][0]) is plan and plan.buckets[0].tables["grads"] is grads_table
    assert_same(pairs)


@pytest.mark.parametrize("cls", [fo.FusedAdam, fo.FusedLAMB])
def test_groups_buckets_and_master_weights(cls):
    """Two groups (one bf16 with master weights), add_param_group later, and step_params
    buckets: each gets its own plan and every result matches the uncached optimizer (for
    LAMB also the gradient norm over all groups, or over the bucket stepped)."""
    def make(ps):
        return cls([{"params": ps[:2]}, {"params": ps[2:4], "master_weights": True}], lr=1e-2)
    g = torch.Generator().manual_seed(5)
    init = ([torch.randn(7, 9, generator=g), torch.randn(40, generator=g)]
            + [torch.randn(33, generator=g).bfloat16(), torch.randn(3, 3, generator=g).bfloat16()]
            + [torch.randn(11, generator=g)])
    sets = [[p.clone().requires_grad_() for p in init] for _ in range(2)]
    opts = [make(ps) for ps in sets]
    opts[1].__dict__["_aiak_plans"] = NoCache()
    pairs = list(zip(opts, sets))
    for s in range(1, 8):
        set_grads(pairs, s)
        if s == 3:
            for opt, ps in pairs:
                opt.add_param_group({"params": [ps[4]], "lr": 0.1})
        elif s < 3:
            for _, ps in pairs:
                ps[4].grad = None
        if s in (5, 6):  # overlapped-update style: buckets stepped on their own
            for opt, ps in pairs:
                opt.step_params([ps[0], ps[2]])
                opt.step_params([ps[1], ps[3], ps[4]])
        else:
            step_both(pairs)
        assert_same(pairs)
    assert len(P.plans_of(opts[0])) >= 3


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_found_inf_and_grad_scale_on_the_planned_path(name):
    pairs = make_pair(MAKERS[name])
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    before = [p.clone() for p in pairs[0][1]]
    for opt, _ in pairs:
        opt.grad_scale = torch.tensor(4.0)
        opt.found_inf = torch.tensor(1.0)
    set_grads(pairs, 3)
    step_both(pairs)
    assert all(torch.equal(p, q) for p, q in zip(before, pairs[0][1]))
    for opt, _ in pairs:
        opt.found_inf = torch.tensor(0.0)
    step_both(pairs)
    assert not torch.equal(before[0], pairs[0][1][0])
    assert_same(pairs)


# --------------------------------------------------------------------------------- LAMB
def test_lamb_plans_match_the_functional_path_bit_for_bit():
    """Planned FusedLAMB (two groups, fp32 and bf16, clipping active) against the functional
    API gathered by hand, the path FusedLAMB took before plans: global_grad_norm over the flat
    gradients, then fused_lamb per group.  The norm summed from the plans' gradient tables
    must give the same bits as the one summed from the tensors."""
    g = torch.Generator().manual_seed(11)
    init = [[torch.randn(s, generator=g) for s in SHAPES],
            [torch.randn(s, generator=g).bfloat16() for s in [(64,), (3, 300)]]]
    decays = (0.01, 0.0)
    ours = [[t.clone().requires_grad_() for t in grp] for grp in init]
    ref = [[t.clone() for t in grp] for grp in init]
    opt = fo.FusedLAMB([{"params": ours[0]}, {"params": ours[1], "weight_decay": decays[1]}],
                       lr=1e-2, weight_decay=decays[0], max_grad_norm=0.5)
    states = [[[torch.zeros_like(t, dtype=torch.float32) for t in grp] for _ in range(2)]
              + [[torch.zeros(()) for _ in grp]] for grp in init]
    for _ in range(5):
        for grp_o, grp_r in zip(ours, ref):
            for p, q in zip(grp_o, grp_r):
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
                q.grad = p.grad.clone()
        opt.step()
        norm = fo.global_grad_norm([q.grad for grp in ref for q in grp])
        assert float(norm) > 0.5  # clipping is active
        for grp, (m, v, steps), wd in zip(ref, states, decays):
            fo.fused_lamb(grp, [q.grad for q in grp], m, v, steps, lr=1e-2, beta1=0.9,
                          beta2=0.999, eps=1e-6, weight_decay=wd, max_grad_norm=0.5,
                          grad_norm=norm)
        for grp_o, grp_r, (m, v, steps) in zip(ours, ref, states):
            for i, (p, q) in enumerate(zip(grp_o, grp_r)):
                assert torch.equal(p, q)
                st = opt.state[p]
                assert torch.equal(st["exp_avg"], m[i]) and torch.equal(st["exp_avg_sq"], v[i])
                assert torch.equal(st["step"], steps[i])
    assert plan_of(opt, 0) is not None and plan_of(opt, 1) is not None


def test_lamb_dtype_change_rebuilds_the_plan():
    """model.bfloat16()-style: params become bf16 (their fp32 states stay valid); the plan
    is rebuilt with bf16 kernels and matches the uncached optimizer."""
    pairs = make_pair(MAKERS["lamb"])
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    plan = plan_of(pairs[0][0])
    assert plan.buckets[0].dtype == torch.float32
    for _, params in pairs:
        for p in params:
            p.data = p.data.bfloat16()
    for s in (3, 4):
        set_grads(pairs, s)
        step_both(pairs)
        assert_same(pairs)
    new = plan_of(pairs[0][0])
    assert new is not plan and [b.dtype for b in new.buckets] == [torch.bfloat16]


def test_lamb_mixed_planned_and_unplanned_groups():
    """A group whose gradient the kernels cannot walk (transposed) takes the reference path;
    the other group keeps its plan, and the global norm covers both."""
    def make(ps):
        return fo.FusedLAMB([{"params": ps[:3]}, {"params": ps[3:]}], lr=1e-2,
                            max_grad_norm=0.5)
    pairs = make_pair(make)
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    plan0 = plan_of(pairs[0][0], 0)
    for s in (3, 4):
        set_grads(pairs, s)
        for _, params in pairs:  # param 1 is (5, 19): a transposed (19, 5) gradient
            params[1].grad = torch.full((19, 5), 0.25 * s).t()
        step_both(pairs)
        assert_same(pairs)
    assert plan_of(pairs[0][0], 0) is None and plan_of(pairs[0][0], 1) is not None
    set_grads(pairs, 5)
    step_both(pairs)
    assert_same(pairs)
    assert plan_of(pairs[0][0], 0) not in (None, plan0)


def test_plans_are_not_pickled_or_copied():
    import copy
    import pickle
    pairs = make_pair(MAKERS["adam"])
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    opt = pairs[0][0]
    assert "_aiak_plans" not in opt.__getstate__()
    clone = copy.deepcopy(opt)
    assert "_aiak_plans" not in clone.__dict__
    pickle.loads(pickle.dumps(opt.state_dict()))


# ---------------------------------------------------------------- CUDA branch, faked
class FakeCudaLib:
    """Stands in for libaiak_fused_cuda.so: runs the CPU kernels on the addresses in the
    ctypes arrays it receives (CPU tensors), and records those array objects."""

    def __init__(self):
        self.calls = []
        self.norm_calls = []

    @staticmethod
    def _list(arr, n):
        return [] if arr is None else [int(x or 0) for x in arr[:n]]

    @staticmethod
    def _scalar(ptr):
        return 0.0 if not ptr else ctypes.c_float.from_address(ptr).value

    def aiak_fused_adam_cuda(self, n, numels, p, g, m, v, vmax, master, steps, dtype, lr, b1, b2,
                             eps, wd, decoupled, amsgrad, maximize, gs, fi, stream):
        self.calls.append(("adam", p, g, m, v, steps, numels))
        if self._scalar(fi) != 0.0:
            return 0
        L = lambda a: self._list(a, n)  # noqa: E731
        B.cpu_ext.adam(L(p), L(g), L(m), L(v), L(vmax) if amsgrad else [], L(master), L(steps),
                       list(numels[:n]), dtype, lr, b1, b2, eps, wd, bool(decoupled),
                       bool(amsgrad), bool(maximize), self._scalar(gs), 1)
        return 0

    def aiak_fused_sgd_cuda(self, n, numels, p, g, buf, master, first, dtype, lr, momentum,
                            dampening, wd, nesterov, maximize, gs, fi, stream):
        self.calls.append(("sgd", p, g, buf, numels))
        if self._scalar(fi) != 0.0:
            return 0
        L = lambda a: self._list(a, n)  # noqa: E731
        B.cpu_ext.sgd(L(p), L(g), L(buf) if momentum != 0 else [], L(master),
                      [int(f) for f in first[:n]] if momentum != 0 else [], list(numels[:n]),
                      dtype, lr, momentum, dampening, wd, bool(nesterov), bool(maximize),
                      self._scalar(gs), 1)
        return 0

    @staticmethod
    def aiak_fused_lamb_cuda_workspace_bytes(n, numels):
        return 8

    def aiak_fused_lamb_cuda(self, n, numels, p, g, m, v, master, steps, dtype, lr, b1, b2, eps,
                             wd, bias_correction, grad_averaging, adam_w_mode, nvlamb,
                             max_grad_norm, grad_norm, gs, fi, workspace, stream):
        self.calls.append(("lamb", p, g, m, v, steps, numels))
        if self._scalar(fi) != 0.0:
            return 0
        # The device kernels read the global norm (float32) and clip on the device.
        norm = self._scalar(grad_norm)
        clip = norm / max_grad_norm if grad_norm and max_grad_norm > 0 and norm > max_grad_norm else 1.0
        L = lambda a: self._list(a, n)  # noqa: E731
        B.cpu_ext.lamb(L(p), L(g), L(m), L(v), L(master), L(steps), list(numels[:n]), dtype, lr,
                       b1, b2, eps, wd, bool(bias_correction), bool(grad_averaging),
                       bool(adam_w_mode), bool(nvlamb), clip, self._scalar(gs), 1)
        return 0

    def aiak_fused_sum_squares_cuda(self, n, numels, tensors, dtype, out, workspace, stream):
        self.norm_calls.append((self._list(tensors, n), list(numels[:n])))
        sums = B.cpu_ext.sum_squares(self._list(tensors, n), list(numels[:n]), dtype, 1)
        ctypes.c_float.from_address(out).value = sum(sums)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    lib = FakeCudaLib()
    monkeypatch.setattr(P, "uses_cuda_tables", lambda device: True)
    monkeypatch.setattr(B, "cuda_lib", lambda: lib)
    monkeypatch.setattr(B, "cuda_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return lib


@pytest.mark.parametrize("name", ["adam", "adamw-amsgrad", "sgd-momentum", "sgd-plain", "lamb"])
def test_cuda_tables_are_built_once_per_layout(fake_cuda, name):
    """Planned steps hand the CUDA library the same pointer arrays every step (only the
    gradient array is new when the gradients are new tensors) and give the same bits as the
    unplanned path."""
    pairs = make_pair(MAKERS[name])
    for s in range(1, 7):
        if s < 5:
            set_grads(pairs, s)
        if s == 5:  # gradients kept in place from here on: no table changes at all
            for _, params in pairs:
                for p in params:
                    p.grad = torch.zeros_like(p) + 0.01
        if s > 5:
            for _, params in pairs:
                for p in params:
                    p.grad.mul_(1.5)
        step_both(pairs)
        assert_same(pairs)
    # One call per step and optimizer (one dtype), the cached optimizer's first.
    assert len(fake_cuda.calls) == 12
    ours, uncached = fake_cuda.calls[0::2], fake_cuda.calls[1::2]
    planned = ours[2:]  # SGD with momentum caches its plan after its first step
    assert len({id(c[1]) for c in planned}) == 1, "param table rebuilt on a steady step"
    assert len({id(c[-1]) for c in planned}) == 1, "numels array rebuilt"
    assert ours[5][2] is ours[4][2], "gradient table rebuilt though the gradients are in place"
    # The calls keep every array alive, so distinct ids are distinct arrays.
    assert len({id(c[1]) for c in uncached}) == 6, "the uncached path builds tables each step"


def test_cuda_branch_found_inf_is_checked_on_the_device(fake_cuda):
    pairs = make_pair(MAKERS["adam"])
    for s in (1, 2):
        set_grads(pairs, s)
        step_both(pairs)
    opt, params = pairs[0]
    before = [p.clone() for p in params]
    opt.found_inf = torch.tensor(1.0)
    n = len(fake_cuda.calls)
    set_grads(pairs[:1], 3)
    opt.step()
    assert len(fake_cuda.calls) == n + 1  # launched: the kernel, not the host, skips
    assert all(torch.equal(p, q) for p, q in zip(before, params))


def test_cuda_branch_lamb_norm_is_one_call_over_all_groups(fake_cuda):
    """Two LAMB groups on the CUDA branch: each step sums the squares of every gradient in one
    library call, over the groups' planned gradient tables joined in parameter order, and
    matches the uncached optimizer."""
    def make(ps):
        return fo.FusedLAMB([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2}], lr=1e-2,
                            max_grad_norm=0.5)
    pairs = make_pair(make)
    for s in range(1, 5):
        set_grads(pairs, s)
        del fake_cuda.norm_calls[:]
        pairs[0][0].step()
        assert len(fake_cuda.norm_calls) == 1
        ptrs, numels = fake_cuda.norm_calls[0]
        assert ptrs == [p.grad.data_ptr() for p in pairs[0][1]]
        assert numels == [p.numel() for p in pairs[0][1]]
        pairs[1][0].step()
        assert_same(pairs)
    assert plan_of(pairs[0][0], 0) is not None and plan_of(pairs[0][0], 1) is not None
