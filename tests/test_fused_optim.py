"""Fused optimizers on CPU against torch.optim (computed independently, step by step).

Tolerances: fp32 results must agree with torch's for-loop implementation to ~1e-6 (Adam/AdamW;
the only systematic difference is that torch's vectorised sqrt is not correctly rounded) or
exactly (SGD).  fp64 to ~1e-12.  bf16/fp16 params are compared with a torch reference that
does the same maths on fp32 copies and rounds the params to bf16/fp16 after every step (or
keeps an fp32 master copy), within one bf16/fp16 rounding step.
"""
import math
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import aiak_training.fused_optim as fo
from aiak_training.fused_optim import _backend as B

pytestmark = pytest.mark.skipif(B.cpu_ext is None, reason="aiak_training.fused_optim._cpu not built")

# Includes empty tensors, sizes that are not multiples of any vector width, a 4-D tensor and
# one tensor spanning several 32K-element work chunks (so two threads share the work).
SHAPES = [(0,), (1,), (7,), (17,), (33,), (5, 19), (3, 4, 5, 6), (70_001,)]
LOWP = (torch.bfloat16, torch.float16)
STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def _two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def isa():
    """Restores the auto-detected SIMD path after a test that forces one."""
    before = B.cpu_ext.isa()
    yield B.cpu_ext.set_isa
    B.cpu_ext.set_isa(before)


def ref_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def make_params(dtype, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def grad_stream(dtype, steps, seed=1, shapes=SHAPES, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=g) * scale).to(dtype) for s in shapes] for _ in range(steps)]


def tol(dtype):
    if dtype == torch.float64:
        return dict(rtol=1e-12, atol=1e-12)
    if dtype == torch.float32:
        return dict(rtol=1e-6, atol=1e-6)
    # one rounding step of the low-precision format (plus slack for a flipped rounding)
    eps = torch.finfo(dtype).eps
    return dict(rtol=2 * eps, atol=1e-4)


def run_against_reference(make_ours, make_ref, dtype, master=False, steps=STEPS,
                          state_keys=(), shapes=SHAPES, grad_scale=1.0):
    """Steps a fused optimizer on `dtype` params and a torch.optim optimizer on fp32/fp64
    copies with the same gradients; returns both param lists and optimizers."""
    init = make_params(dtype, shapes=shapes)
    ours = [p.clone().requires_grad_() for p in init]
    rd = ref_dtype(dtype)
    refs = [p.to(rd).requires_grad_() for p in init]
    opt = make_ours(ours)
    ref = make_ref(refs)
    for grads in grad_stream(dtype, steps, shapes=shapes, scale=grad_scale):
        for p, r, g in zip(ours, refs, grads):
            p.grad = g.clone()
            r.grad = g.to(rd)
        opt.step()
        ref.step()
        if dtype in LOWP and not master:
            with torch.no_grad():  # the fused path rounds params to bf16/fp16 every step
                for r in refs:
                    r.copy_(r.to(dtype).to(rd))
    for p, r in zip(ours, refs):
        torch.testing.assert_close(p, r.to(dtype), **tol(dtype))
        if master and dtype in LOWP and p.numel():
            torch.testing.assert_close(opt.state[p]["master_param"], r, rtol=1e-6, atol=1e-6)
        for key in state_keys:
            if key in ref.state[r]:
                st, rt = opt.state[p][key], ref.state[r][key]
                assert st.dtype == B.state_dtype(dtype)
                if dtype in LOWP:
                    torch.testing.assert_close(st, rt, rtol=1e-3, atol=1e-4)
                else:
                    torch.testing.assert_close(st, rt, **tol(dtype))
        if "step" in ref.state[r]:
            assert float(opt.state[p]["step"]) == float(ref.state[r]["step"]) == steps
    return ours, refs, opt, ref


DTYPE_CASES = [(torch.float32, False), (torch.float64, False), (torch.bfloat16, False),
               (torch.bfloat16, True), (torch.float16, False), (torch.float16, True)]
DTYPE_IDS = ["fp32", "fp64", "bf16", "bf16-master", "fp16", "fp16-master"]


# ----------------------------------------------------------------------------------- Adam
ADAM_VARIANTS = {
    "adam": (fo.FusedAdam, torch.optim.Adam, {}),
    "adam-decoupled": (fo.FusedAdam, torch.optim.Adam, {"decoupled_weight_decay": True}),
    "adamw": (fo.FusedAdamW, torch.optim.AdamW, {}),
}


@pytest.mark.parametrize("dtype,master", DTYPE_CASES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", list(ADAM_VARIANTS))
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_torch(variant, amsgrad, maximize, weight_decay, dtype, master):
    ours_cls, ref_cls, extra = ADAM_VARIANTS[variant]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, amsgrad=amsgrad,
              maximize=maximize, **extra)
    run_against_reference(
        lambda ps: ours_cls(ps, master_weights=master, **kw),
        lambda ps: ref_cls(ps, foreach=False, **kw), dtype, master=master,
        state_keys=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))


def test_adam_beta1_above_half_uses_other_lerp_branch():
    kw = dict(lr=1e-2, betas=(0.3, 0.9), weight_decay=0.01)
    run_against_reference(lambda ps: fo.FusedAdam(ps, **kw),
                          lambda ps: torch.optim.Adam(ps, foreach=False, **kw), torch.float32,
                          state_keys=("exp_avg", "exp_avg_sq"))


def test_adam_defaults_match_torch():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for ours, ref in [(fo.FusedAdam(p), torch.optim.Adam(p)), (fo.FusedAdamW(p), torch.optim.AdamW(p)),
                      (fo.FusedSGD(p), torch.optim.SGD(p))]:
        for k, v in ref.defaults.items():
            assert ours.defaults[k] == v, (type(ours).__name__, k)
        assert set(ref.param_groups[0]) <= set(ours.param_groups[0])


# ------------------------------------------------------------------------------------ SGD
SGD_CASES = [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.0, True), (0.9, 0.3, False)]


@pytest.mark.parametrize("dtype,master", DTYPE_CASES, ids=DTYPE_IDS)
@pytest.mark.parametrize("momentum,dampening,nesterov", SGD_CASES,
                         ids=["plain", "momentum", "nesterov", "dampening"])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_sgd_matches_torch(momentum, dampening, nesterov, maximize, weight_decay, dtype, master):
    kw = dict(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov,
              weight_decay=weight_decay, maximize=maximize)
    ours, refs, _, _ = run_against_reference(
        lambda ps: fo.FusedSGD(ps, master_weights=master, **kw),
        lambda ps: torch.optim.SGD(ps, foreach=False, **kw), dtype, master=master,
        state_keys=("momentum_buffer",))
    if dtype == torch.float32:
        # Same ATen operation order, all exactly rounded: bit-identical to torch.
        for p, r in zip(ours, refs):
            assert torch.equal(p, r)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch_ops"])
def test_fused_sgd_without_momentum_takes_no_first_step_flags(use_kernels):
    """FusedSGD passes no buffers and no first-step flags when momentum is 0; every path
    (the CPU kernel, the per-tensor fallback and, on a GPU, the CUDA launch) must accept that."""
    torch.manual_seed(3)
    params = [torch.randn(n, dtype=torch.float64) for n in (5, 17)]
    grads = [torch.randn_like(p) for p in params]
    expected = [p - 0.1 * g for p, g in zip(params, grads)]
    fo.fused_sgd(params, grads, [], None, [], weight_decay=0.0, momentum=0.0, lr=0.1,
                 dampening=0.0, nesterov=False, maximize=False, use_kernels=use_kernels)
    for p, e in zip(params, expected):
        # One rounding step apart at most (the kernel may fuse the multiply-add).
        torch.testing.assert_close(p, e, rtol=0, atol=1e-15)


# ----------------------------------------------------------------------------------- LAMB
def lamb_reference(params, grad_steps, *, lr, betas, eps, weight_decay, bias_correction,
                   grad_averaging, adam_w_mode, use_nvlamb, max_grad_norm, round_to=None):
    """LAMB per the paper / Apex FusedLAMB, written independently in float64."""
    b1, b2 = betas
    ps = [p.double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t, grads in enumerate(grad_steps, start=1):
        gs = [g.double() for g in grads]
        norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
        clip = norm / max_grad_norm if (max_grad_norm and norm > max_grad_norm) else 1.0
        for i, (p, g) in enumerate(zip(ps, gs)):
            g = g / clip
            if not adam_w_mode:
                g = g + weight_decay * p
            ms[i] = b1 * ms[i] + ((1 - b1) if grad_averaging else 1.0) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            bc1 = 1 - b1 ** t if bias_correction else 1.0
            bc2 = 1 - b2 ** t if bias_correction else 1.0
            u = (ms[i] / bc1) / ((vs[i] / bc2).sqrt() + eps)
            if adam_w_mode:
                u = u + weight_decay * p
            pn, un = float(p.norm()), float(u.norm())
            trust = pn / un if (weight_decay != 0 or use_nvlamb) and pn > 0 and un > 0 else 1.0
            p.sub_(lr * trust * u)
            if round_to is not None:
                p.copy_(p.to(round_to).double())
    return ps, ms, vs


LAMB_CASES = [
    dict(),
    dict(adam_w_mode=False),
    dict(grad_averaging=False, bias_correction=False),
    dict(weight_decay=0.0),
    dict(weight_decay=0.0, use_nvlamb=True),
    dict(max_grad_norm=None),
    dict(max_grad_norm=1e4),  # no clipping needed
]


def lamb_case_id(case) -> str:
    return ",".join(f"{k}={v}" for k, v in case.items()) or "default"


@pytest.mark.parametrize("dtype,master", DTYPE_CASES[:4], ids=DTYPE_IDS[:4])
@pytest.mark.parametrize("case", LAMB_CASES, ids=lamb_case_id)
def test_lamb_matches_reference(case, dtype, master):
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
              grad_averaging=True, adam_w_mode=True, use_nvlamb=False, max_grad_norm=1.0)
    kw.update(case)
    init = make_params(dtype)
    ours = [p.clone().requires_grad_() for p in init]
    opt = fo.FusedLAMB(ours, master_weights=master, **kw)
    grads = grad_stream(dtype, STEPS)
    for gs in grads:
        for p, g in zip(ours, gs):
            p.grad = g.clone()
        opt.step()
    ref_p, ref_m, ref_v = lamb_reference(init, grads, round_to=dtype if dtype in LOWP and not master else None, **kw)
    for p, rp, rm, rv in zip(ours, ref_p, ref_m, ref_v):
        st = opt.state[p]
        assert float(st["step"]) == STEPS
        if dtype in LOWP:
            torch.testing.assert_close(p.double(), rp.to(dtype).double(), **tol(dtype))
            if master:
                # fp32 maths vs the float64 reference: where g/clip + wd*p nearly cancels
                # (L2 mode), u = m/(sqrt(v)+eps) amplifies fp32 rounding; 1e-4 covers it.
                torch.testing.assert_close(st["master_param"].double(), rp, rtol=1e-4, atol=1e-4)
        else:
            t = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(p.double(), rp, **t)
            torch.testing.assert_close(st["exp_avg"].double(), rm, **t)
            torch.testing.assert_close(st["exp_avg_sq"].double(), rv, **t)


def fma32(a, b, c) -> np.ndarray:
    """float32 ``a * b + c`` rounded once, as a fused multiply-add.  The product is exact in
    float64; the float64 sum is made round-to-odd (an inexact sum gets an odd last bit), which
    then rounds to float32 exactly as the single rounding would."""
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    prod = a * b
    s = prod + c
    back = s - prod
    err = (prod - (s - back)) + (c - back)  # exact: s + err == prod + c
    fix = (err != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def lamb_reference_f32(params, grad_steps, *, lr, betas, eps, weight_decay, bias_correction,
                       grad_averaging, adam_w_mode, use_nvlamb, max_grad_norm):
    """LAMB in float32 with the operation order the fused kernels specify (csrc/fused_optim/
    kernels_impl.h), in numpy: constants rounded to float32 once, fused multiply-adds where
    the kernels use them, norms from float64 sums.  The kernels must match it bit for bit."""
    f32 = np.float32
    b1, b2 = betas
    ps = [p.numpy().copy() for p in params]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    sq = lambda x: float(np.sum(x.astype(np.float64) ** 2))  # noqa: E731
    for t, grads in enumerate(grad_steps, start=1):
        gs = [g.numpy() for g in grads]
        norm = math.sqrt(math.fsum(sq(g) for g in gs))
        clip = norm / max_grad_norm if (max_grad_norm and norm > max_grad_norm) else 1.0
        bc1 = f32(1 - b1 ** t if bias_correction else 1.0)
        bc2 = f32(1 - b2 ** t if bias_correction else 1.0)
        beta3 = f32(1 - b1 if grad_averaging else 1.0)
        wd = f32(weight_decay)
        for i, (p, g) in enumerate(zip(ps, gs)):
            g = g * f32(1.0 / clip)
            if not adam_w_mode and weight_decay != 0:
                g = fma32(wd, p, g)
            ms[i] = fma32(beta3, g, f32(b1) * ms[i])
            vs[i] = fma32(f32(1.0 - b2), g * g, f32(b2) * vs[i])
            u = (ms[i] / bc1) / (np.sqrt(vs[i] / bc2) + f32(eps))
            if adam_w_mode and weight_decay != 0:
                u = fma32(wd, p, u)
            pn, un = math.sqrt(sq(p)), math.sqrt(sq(u))
            trust = pn / un if (weight_decay != 0 or use_nvlamb) and pn > 0 and un > 0 else 1.0
            ps[i] = fma32(f32(-(lr * trust)), u, p)
    return [[torch.from_numpy(x) for x in xs] for xs in (ps, ms, vs)]


@pytest.mark.parametrize("case", LAMB_CASES, ids=lamb_case_id)
def test_lamb_fp32_matches_its_specified_rounding(isa, case):
    """fp32 LAMB, bit for bit, on every SIMD path.  Norms used to be summed in float lanes,
    which left a relative error of ~1e-6 in the clip factor that differed per ISA; where
    g / clip and wd * p nearly cancel (L2 mode) it reached ~1e-5 of the parameter."""
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
              grad_averaging=True, adam_w_mode=True, use_nvlamb=False, max_grad_norm=1.0)
    kw.update(case)
    init = make_params(torch.float32)
    grads = grad_stream(torch.float32, STEPS)
    ref_p, ref_m, ref_v = lamb_reference_f32(init, grads, **kw)
    for name in B.cpu_ext.supported_isas():
        isa(name)
        ours = [p.clone().requires_grad_() for p in init]
        opt = fo.FusedLAMB(ours, **kw)
        for gs in grads:
            for p, g in zip(ours, gs):
                p.grad = g.clone()
            opt.step()
        for k, (p, rp, rm, rv) in enumerate(zip(ours, ref_p, ref_m, ref_v)):
            st = opt.state[p]
            for got, want, what in ((p.detach(), rp, "param"), (st["exp_avg"], rm, "exp_avg"),
                                    (st["exp_avg_sq"], rv, "exp_avg_sq")):
                assert torch.equal(got, want), (name, k, what, int((got != want).sum()))


def test_lamb_clipping_is_global_across_groups():
    """The clip factor comes from the norm of *all* gradients, as in Apex."""
    init = make_params(torch.float32, shapes=[(50,), (60,)])
    a = [p.clone().requires_grad_() for p in init]
    opt = fo.FusedLAMB([{"params": [a[0]]}, {"params": [a[1]], "lr": 1e-2}], lr=1e-2, max_grad_norm=1.0)
    grads = grad_stream(torch.float32, 2, shapes=[(50,), (60,)])
    for gs in grads:
        for p, g in zip(a, gs):
            p.grad = g.clone()
        opt.step()
    ref_p, _, _ = lamb_reference(init, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                                 bias_correction=True, grad_averaging=True, adam_w_mode=True,
                                 use_nvlamb=False, max_grad_norm=1.0)
    for p, rp in zip(a, ref_p):
        torch.testing.assert_close(p.double(), rp, rtol=1e-5, atol=1e-6)


def test_lamb_options_and_zero_grad():
    p = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(RuntimeError, match="AMSGrad"):
        fo.FusedLAMB([p], amsgrad=True)
    opt = fo.FusedLAMB([p])
    assert opt.defaults["eps"] == 1e-6 and opt.defaults["weight_decay"] == 0.01
    assert opt.defaults["max_grad_norm"] == 1.0 and opt.defaults["adam_w_mode"] is True
    p.grad = torch.ones(4)
    opt.zero_grad()
    assert p.grad is None
    opt = fo.FusedLAMB([p], set_grad_none=False)
    p.grad = torch.ones(4)
    opt.zero_grad()
    assert p.grad is not None and torch.all(p.grad == 0)


# --------------------------------------------------------------------- SIMD paths, threads
def _run_all(dtype, seed=0):
    """Adam (amsgrad, L2, maximize), AdamW, SGD (nesterov) and LAMB (decoupled and L2) on the
    same data."""
    out = []
    for make in (lambda ps: fo.FusedAdam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
                 lambda ps: fo.FusedAdamW(ps, lr=1e-2, betas=(0.4, 0.9)),
                 lambda ps: fo.FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                 lambda ps: fo.FusedLAMB(ps, lr=1e-2),
                 lambda ps: fo.FusedLAMB(ps, lr=1e-2, adam_w_mode=False)):
        ps = [p.requires_grad_() for p in make_params(dtype, seed)]
        opt = make(ps)
        for gs in grad_stream(dtype, 3):
            for p, g in zip(ps, gs):
                p.grad = g
            opt.step()
        out.append([p.detach().clone() for p in ps] + [t.clone() for s in opt.state.values()
                                                        for t in s.values() if torch.is_tensor(t)])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_simd_paths_agree_bitwise(isa, dtype):
    """Scalar, AVX2 and AVX-512 kernels use the same exactly-rounded operations.  LAMB's
    norms are float64 sums in a different lane order per ISA: equal to far below a float's
    resolution, so the trust ratios and clip factors round to the same float32."""
    isa("scalar")
    expected = _run_all(dtype)
    for name in B.cpu_ext.supported_isas()[1:]:
        isa(name)
        got = _run_all(dtype)
        for alg, (e_list, g_list) in enumerate(zip(expected, got)):
            for e, g in zip(e_list, g_list):
                assert torch.equal(e, g), (name, alg)


def test_scalar_path_matches_torch(isa):
    isa("scalar")
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
    run_against_reference(lambda ps: fo.FusedAdam(ps, **kw),
                          lambda ps: torch.optim.Adam(ps, foreach=False, **kw), torch.float32,
                          state_keys=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    kw = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    ours, refs, _, _ = run_against_reference(lambda ps: fo.FusedSGD(ps, **kw),
                                             lambda ps: torch.optim.SGD(ps, foreach=False, **kw),
                                             torch.float32)
    assert all(torch.equal(p, r) for p, r in zip(ours, refs))


def test_results_do_not_depend_on_thread_count(monkeypatch):
    monkeypatch.setenv("AIAK_FUSED_OPTIM_THREADS", "1")
    one = _run_all(torch.float32)
    monkeypatch.setenv("AIAK_FUSED_OPTIM_THREADS", "2")
    two = _run_all(torch.float32)
    for a, b in zip(one, two):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_torch_openmp_threads_and_own_pool_agree(monkeypatch):
    """Parallel calls run on torch's OpenMP threads where torch's OpenMP runtime is loaded
    (the default), or on the extension's own pool: the same bits either way."""
    monkeypatch.setenv("AIAK_FUSED_OPTIM_THREADS", "2")
    monkeypatch.delenv(B.THREADS_ENV_VAR, raising=False)
    if "OpenMP" in torch.__config__.parallel_info() and sys.platform == "linux":
        assert os.path.basename(B.torch_openmp_library()).startswith("libgomp")
        assert B.choose_thread_pool() == "openmp"
    try:
        on_openmp = _run_all(torch.float32)
        assert B.choose_thread_pool("own") == "pool"
        own = _run_all(torch.float32)
    finally:
        B.choose_thread_pool()
    for a, b in zip(on_openmp, own):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_forked_child_steps_on_its_own_pool():
    """GNU OpenMP hangs in a forked child whose parent ran OpenMP threads: after fork() the
    kernels go back to their own pool, so a child's step finishes (within the timeout)."""
    code = (
        "import os, torch\n"
        "import aiak_training.fused_optim as fo\n"
        "ps = [torch.randn(1 << 20) for _ in range(4)]\n"
        "for p in ps: p.grad = torch.ones_like(p)\n"
        "opt = fo.FusedAdam(ps, lr=1e-3); opt.step()\n"
        "print('parent', fo._cpu_ext.threads_backend(), flush=True)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        # No torch op on whole tensors in the child: torch's own would hang there.
        "    before = float(ps[0][0]); opt.step()\n"
        "    moved = float(ps[0][0]) < before\n"
        "    print('child', fo._cpu_ext.threads_backend(), moved, flush=True); os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('status', status)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, AIAK_FUSED_OPTIM_THREADS="2"))
    lines = out.stdout.split("\n")
    assert lines[0] == "parent " + B.choose_thread_pool(), out.stdout + out.stderr
    assert "child pool True" in lines and "status 0" in lines, out.stdout + out.stderr


def test_thread_pool_setting_is_checked():
    code = "import aiak_training.fused_optim as fo; print(fo._cpu_ext.threads_backend())"
    run = lambda value: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], capture_output=True, text=True,
        env=dict(os.environ, AIAK_FUSED_OPTIM_THREAD_POOL=value))
    assert run("own").stdout.split() == ["pool"]
    bad = run("many")
    assert bad.returncode != 0 and "AIAK_FUSED_OPTIM_THREAD_POOL" in bad.stderr \
        and "openmp, own" in bad.stderr, bad.stderr[-2000:]


def test_multi_threaded_calls_take_avx2_on_amd():
    """On AMD CPUs with AVX-512, calls on several threads run the AVX2 kernels (faster there);
    a path forced by AIAK_FUSED_OPTIM_ISA runs at every thread count."""
    code = ("import aiak_training.fused_optim as fo; "
            "print(fo.cpu_isa(1), fo.cpu_isa(2), fo.cpu_isa(8))")
    env = {k: v for k, v in os.environ.items() if k != "AIAK_FUSED_OPTIM_ISA"}
    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    one, two, eight = out.stdout.split()
    best = B.cpu_ext.supported_isas()[-1]
    assert one == best
    assert two == eight == ("avx2" if amd and best == "avx512" else best)
    for forced in B.cpu_ext.supported_isas():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(env, AIAK_FUSED_OPTIM_ISA=forced))
        assert out.stdout.split() == [forced] * 3, out.stderr


def test_thread_count_follows_torch(monkeypatch):
    monkeypatch.delenv("AIAK_FUSED_OPTIM_THREADS", raising=False)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert B.num_threads() == 1
        torch.set_num_threads(2)
        assert B.num_threads() == 2
    finally:
        torch.set_num_threads(old)


# --------------------------------------------------------------- layouts and fallbacks
def test_non_contiguous_and_channels_last_params():
    base = make_params(torch.float32, shapes=[(7, 5), (2, 3, 4, 5)])
    def make(ps_src):
        t = ps_src[0].t().contiguous().t().requires_grad_()  # transposed: non-contiguous leaf
        c = ps_src[1].contiguous(memory_format=torch.channels_last).requires_grad_()
        return [t, c]
    ours, refs = make(base), make(base)
    assert not ours[0].is_contiguous() and ours[1].is_contiguous(memory_format=torch.channels_last)
    opt = fo.FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.Adam(refs, lr=1e-2, weight_decay=0.1, foreach=False)
    for gs in grad_stream(torch.float32, 3, shapes=[(7, 5), (2, 3, 4, 5)]):
        for p, r, g in zip(ours, refs, gs):
            p.grad = g.clone()
            r.grad = g.clone()
        opt.step()
        ref.step()
    for p, r in zip(ours, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("alg", ["adam", "sgd", "lamb"])
def test_reference_path_when_kernels_missing(monkeypatch, alg):
    """Without the compiled module the same classes run the torch-op reference code."""
    kernel = _run_all(torch.float32)
    monkeypatch.setattr(B, "cpu_ext", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fallback = _run_all(torch.float32)
    i = {"adam": 0, "sgd": 2, "lamb": 3}[alg]
    for k, f in zip(kernel[i], fallback[i]):
        torch.testing.assert_close(f, k, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------- per-parameter steps, GradScaler
def test_subset_stepping_uses_per_parameter_steps():
    """Params without a grad are skipped and keep their own step count (as torch)."""
    init = make_params(torch.float32, shapes=[(40,), (50,)])
    ours = [p.clone().requires_grad_() for p in init]
    refs = [p.clone().requires_grad_() for p in init]
    opt = fo.FusedAdam(ours, lr=1e-2)
    ref = torch.optim.Adam(refs, lr=1e-2, foreach=False)
    pattern = [(True, False), (True, False), (False, True), (True, True)]
    for (a, b), gs in zip(pattern, grad_stream(torch.float32, 4, shapes=[(40,), (50,)])):
        for p, r, g, on in zip(ours, refs, gs, (a, b)):
            p.grad = g.clone() if on else None
            r.grad = g.clone() if on else None
        opt.step()
        ref.step()
    assert [float(opt.state[p]["step"]) for p in ours] == [3.0, 2.0]
    for p, r in zip(ours, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


def test_step_params_updates_only_a_subset():
    """step_params(bucket) == a torch step where only the bucket has gradients, and it runs
    the fused update itself even when step() is overridden by a wrapper."""
    init = make_params(torch.float32, shapes=[(40,), (50,), (60,)])
    ours = [p.clone().requires_grad_() for p in init]
    refs = [p.clone().requires_grad_() for p in init]

    class Wrapped(fo.FusedAdamW):
        def step(self, closure=None):
            raise AssertionError("step_params must not go through step()")

    opt = Wrapped(ours, lr=1e-2)
    ref = torch.optim.AdamW(refs, lr=1e-2, foreach=False)
    for k, gs in enumerate(grad_stream(torch.float32, 3, shapes=[(40,), (50,), (60,)])):
        for p, g in zip(ours, gs):
            p.grad = g.clone()
        bucket = [ours[0], ours[2]] if k != 1 else [ours[1]]
        for i, (r, g) in enumerate(zip(refs, gs)):
            r.grad = g.clone() if any(ours[i] is b for b in bucket) else None
        opt.step_params(bucket)
        ref.step()
    assert [float(opt.state[p]["step"]) for p in ours] == [2.0, 1.0, 2.0]
    assert all(len(g["params"]) == 3 for g in opt.param_groups)
    for p, r in zip(ours, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


def _snapshot(opt, params):
    return [p.detach().clone() for p in params] + [
        t.clone() for p in params for t in opt.state[p].values() if torch.is_tensor(t)]


@pytest.mark.parametrize("make", [
    lambda ps: fo.FusedAdam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    lambda ps: fo.FusedSGD(ps, lr=0.1, momentum=0.9),
    lambda ps: fo.FusedLAMB(ps, lr=1e-2),
], ids=["adam", "sgd", "lamb"])
def test_found_inf_leaves_everything_untouched(make):
    ps = [p.requires_grad_() for p in make_params(torch.float32)]
    opt = make(ps)
    grads = grad_stream(torch.float32, 3)
    # first step skipped: no state at all may appear for SGD; Adam/LAMB keep zero states
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    before = [p.detach().clone() for p in ps]
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, ps))
    assert all("momentum_buffer" not in opt.state[p] for p in ps)
    assert all(float(opt.state[p].get("step", 0)) == 0 for p in ps)
    del opt.found_inf
    opt.step()
    for p, g in zip(ps, grads[1]):
        p.grad = g.clone()
    before = _snapshot(opt, ps)
    grads_before = [p.grad.clone() for p in ps]
    opt.found_inf = torch.tensor(1.0)
    opt.grad_scale = torch.tensor(8.0)
    opt.step()
    after = _snapshot(opt, ps)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads_before, ps))


@pytest.mark.parametrize("make", [
    lambda ps: fo.FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: fo.FusedSGD(ps, lr=0.1, momentum=0.9),
    lambda ps: fo.FusedLAMB(ps, lr=1e-2),
], ids=["adam", "sgd", "lamb"])
def test_grad_scale_unscales_and_stores_grads(make):
    """A power-of-two scale is exact: same result as unscaled grads, grads left unscaled."""
    init = make_params(torch.float32)
    a = [p.clone().requires_grad_() for p in init]
    b = [p.clone().requires_grad_() for p in init]
    oa, ob = make(a), make(b)
    ob.grad_scale = torch.tensor(1024.0)
    ob.found_inf = torch.tensor(0.0)
    for gs in grad_stream(torch.float32, 3):
        for p, q, g in zip(a, b, gs):
            p.grad = g.clone()
            q.grad = g * 1024.0
        oa.step()
        ob.step()
        for p, q in zip(a, b):
            assert torch.equal(p.grad, q.grad)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"),
                    reason="torch.amp.GradScaler (CPU) needs torch 2.3 or later")
def test_torch_grad_scaler_drives_fused_adam():
    """torch.amp.GradScaler hands grad_scale/found_inf to the fused step; an overflow step is
    skipped exactly as torch.optim.Adam under the same scaler."""
    scaler_cls = lambda: torch.amp.GradScaler("cpu", init_scale=256.0)  # noqa: E731
    torch.manual_seed(0)
    model_a = torch.nn.Linear(8, 4)
    model_b = torch.nn.Linear(8, 4)
    model_b.load_state_dict(model_a.state_dict())
    opt_a = fo.FusedAdam(model_a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(model_b.parameters(), lr=1e-2, foreach=False)
    sa, sb = scaler_cls(), scaler_cls()
    x = torch.randn(16, 8)
    for i in range(4):
        for model, opt, scaler in ((model_a, opt_a, sa), (model_b, opt_b, sb)):
            opt.zero_grad()
            loss = model(x).pow(2).mean() * (float("inf") if i == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert sa.get_scale() == sb.get_scale()
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        assert float(opt_a.state[p]["step"]) == float(opt_b.state[q]["step"]) == 3


# ------------------------------------------------------------------------------ state_dict
PAIRS = [
    ("adam", fo.FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("adamw", fo.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95))),
    ("sgd", fo.FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
]


def _two_groups(params):
    return [{"params": params[:3]}, {"params": params[3:], "lr": 5e-3}]


@pytest.mark.parametrize("direction", ["fused_to_torch", "torch_to_fused"])
@pytest.mark.parametrize("name,fused_cls,torch_cls,kw", PAIRS, ids=[p[0] for p in PAIRS])
def test_state_dict_round_trip(name, fused_cls, torch_cls, kw, direction):
    """Train 3 steps with one class, load its state_dict into the other, train 2 more; the
    result equals training 5 steps with torch.optim alone."""
    grads = grad_stream(torch.float32, 5)
    init = make_params(torch.float32)
    ref_p = [p.clone().requires_grad_() for p in init]
    ref = torch_cls(_two_groups(ref_p), foreach=False, **kw)
    first_cls, second_cls = (fused_cls, torch_cls) if direction == "fused_to_torch" else (torch_cls, fused_cls)
    p1 = [p.clone().requires_grad_() for p in init]
    o1 = first_cls(_two_groups(p1), **kw)
    for gs in grads[:3]:
        for p, r, g in zip(p1, ref_p, gs):
            p.grad, r.grad = g.clone(), g.clone()
        o1.step()
        ref.step()
    sd = o1.state_dict()
    p2 = [p.detach().clone().requires_grad_() for p in p1]
    o2 = second_cls(_two_groups(p2), **kw)
    o2.load_state_dict(sd)
    assert o2.param_groups[1]["lr"] == 5e-3
    for gs in grads[3:]:
        for p, r, g in zip(p2, ref_p, gs):
            p.grad, r.grad = g.clone(), g.clone()
        o2.step()
        ref.step()
    for p, r in zip(p2, ref_p):
        torch.testing.assert_close(p, r, rtol=2e-6, atol=2e-6)
        for key, value in ref.state[r].items():
            torch.testing.assert_close(o2.state[p][key].float(), value.float(), rtol=2e-6, atol=2e-6)


def test_low_precision_state_keeps_fp32_through_checkpoints():
    ps = [p.requires_grad_() for p in make_params(torch.bfloat16)]
    opt = fo.FusedAdam(ps, lr=1e-2, master_weights=True)
    for gs in grad_stream(torch.bfloat16, 2):
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
    sd = opt.state_dict()
    ps2 = [p.detach().clone().requires_grad_() for p in ps]
    opt2 = fo.FusedAdam(ps2, lr=1e-2, master_weights=True)
    opt2.load_state_dict(sd)
    for p, q in zip(ps, ps2):
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert opt2.state[q][key].dtype == torch.float32
            assert torch.equal(opt2.state[q][key], opt.state[p][key])
    # a torch checkpoint of bf16 params (bf16 states) loads and is upcast
    tp = [p.detach().clone().requires_grad_() for p in ps]
    topt = torch.optim.Adam(tp, lr=1e-2)
    for p in tp:
        p.grad = torch.ones_like(p)
    topt.step()
    opt3 = fo.FusedAdam([p.detach().clone().requires_grad_() for p in ps], lr=1e-2)
    opt3.load_state_dict(topt.state_dict())
    for st in opt3.state.values():
        assert st["exp_avg"].dtype == torch.float32 and st["step"].dtype == torch.float32


def test_lamb_state_dict_round_trip():
    grads = grad_stream(torch.float32, 4)
    init = make_params(torch.float32)
    a = [p.clone().requires_grad_() for p in init]
    oa = fo.FusedLAMB(a, lr=1e-2)
    b = [p.clone().requires_grad_() for p in init]
    ob = fo.FusedLAMB(b, lr=1e-2)
    for i, gs in enumerate(grads):
        for p, q, g in zip(a, b, gs):
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
        if i == 1:
            sd = ob.state_dict()
            b = [p.detach().clone().requires_grad_() for p in b]
            ob = fo.FusedLAMB(b, lr=1e-2)
            ob.load_state_dict(sd)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    # Loading adds nothing to the param groups (torch's __setstate__ would add
    # "differentiable", an option FusedLAMB does not have): the state dicts stay equal.
    assert ob.param_groups[0].keys() == oa.param_groups[0].keys()
    assert ob.defaults == oa.defaults


# ----------------------------------------------------------------------------- schedulers
@pytest.mark.parametrize("name,fused_cls,torch_cls,kw", PAIRS, ids=[p[0] for p in PAIRS])
@pytest.mark.parametrize("sched", ["step", "onecycle"])
def test_lr_scheduler_interplay(name, fused_cls, torch_cls, kw, sched):
    init = make_params(torch.float32, shapes=[(33,), (5, 7)])
    out = []
    for cls in (fused_cls, torch_cls):
        ps = [p.clone().requires_grad_() for p in init]
        extra = {"foreach": False} if cls is torch_cls else {}
        opt = cls(ps, **kw, **extra)
        if sched == "step":
            s = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        else:  # also cycles betas (Adam) / momentum (SGD)
            s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)
        lrs = []
        for gs in grad_stream(torch.float32, 6, shapes=[(33,), (5, 7)]):
            for p, g in zip(ps, gs):
                p.grad = g
            opt.step()
            s.step()
            lrs.append(opt.param_groups[0]["lr"])
        out.append((ps, lrs))
    (ours, lrs_a), (refs, lrs_b) = out
    assert lrs_a == lrs_b
    for p, r in zip(ours, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ bad input
def test_sparse_gradient_is_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    for cls in (fo.FusedAdam, fo.FusedSGD, fo.FusedLAMB):
        with pytest.raises(RuntimeError, match="sparse gradients"):
            cls(emb.parameters()).step()


def test_mixed_devices_in_one_group_are_rejected():
    cpu = torch.nn.Parameter(torch.zeros(3))
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    for cls in (fo.FusedAdam, fo.FusedAdamW, fo.FusedSGD, fo.FusedLAMB):
        with pytest.raises(ValueError, match="same device"):
            cls([cpu, meta])
    with pytest.raises(ValueError, match="CPU and CUDA"):
        fo.FusedAdam([meta])


def test_unsupported_dtype_is_rejected():
    c = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    for cls in (fo.FusedAdam, fo.FusedSGD, fo.FusedLAMB):
        with pytest.raises(TypeError, match="float32, float64, float16 and bfloat16"):
            cls([c])
    opt = fo.FusedAdam([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(TypeError, match="float32, float64, float16 and bfloat16"):
        opt.add_param_group({"params": [c]})


def test_other_bad_arguments():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="learning rate"):
        fo.FusedAdam([p], lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        fo.FusedAdamW([p], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="Nesterov"):
        fo.FusedSGD([p], nesterov=True)
    with pytest.raises(ValueError, match="differentiable"):
        fo.FusedAdam([p], differentiable=True)
    opt = fo.FusedAdam([p])
    p.grad = torch.zeros(3)
    p.grad.data = torch.zeros(3, dtype=torch.float64)  # autograd would refuse this, .data does not
    with pytest.raises(TypeError, match="gradient dtype"):
        opt.step()


def test_closure_and_no_grads():
    p = torch.nn.Parameter(torch.ones(3))
    opt = fo.FusedAdam([p], lr=0.1)
    assert opt.step() is None  # no grads: nothing happens, no state
    assert len(opt.state) == 0

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 3.0 and float(opt.state[p]["step"]) == 1.0
    assert torch.all(p < 1.0)


# ------------------------------------------------------------------- AIAK_FUSED_OPTIMIZER
@pytest.mark.parametrize("name,fused_cls,torch_cls,kw", PAIRS, ids=[p[0] for p in PAIRS])
def test_maybe_fuse_swaps_and_carries_state(monkeypatch, name, fused_cls, torch_cls, kw):
    init = make_params(torch.float32)
    grads = grad_stream(torch.float32, 4)
    ps = [p.clone().requires_grad_() for p in init]
    opt = torch_cls(_two_groups(ps), foreach=False, **kw)
    monkeypatch.delenv("AIAK_FUSED_OPTIMIZER", raising=False)
    assert fo.maybe_fuse(opt) is opt
    monkeypatch.setenv("AIAK_FUSED_OPTIMIZER", "0")
    assert fo.maybe_fuse(opt) is opt
    refs = [p.clone().requires_grad_() for p in init]
    ref = torch_cls(_two_groups(refs), foreach=False, **kw)
    for p, r, g in zip(ps, refs, grads[0]):
        p.grad, r.grad = g.clone(), g.clone()
    opt.step()
    ref.step()
    monkeypatch.setenv("AIAK_FUSED_OPTIMIZER", "1")
    fused = fo.maybe_fuse(opt)
    assert type(fused) is fused_cls
    assert [p for g in fused.param_groups for p in g["params"]] == ps  # the same tensors
    assert fused.param_groups[1]["lr"] == 5e-3 and fused.defaults["lr"] == kw["lr"]
    for gs in grads[1:]:
        for p, r, g in zip(ps, refs, gs):
            p.grad, r.grad = g.clone(), g.clone()
        fused.step()
        ref.step()
    for p, r in zip(ps, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


def test_maybe_fuse_leaves_other_optimizers(monkeypatch):
    monkeypatch.setenv("AIAK_FUSED_OPTIMIZER", "1")
    p = torch.nn.Parameter(torch.zeros(3))

    class MyAdam(torch.optim.Adam):
        pass

    for opt in (torch.optim.RMSprop([p]), MyAdam([p]), fo.FusedAdam([p])):
        assert fo.maybe_fuse(opt) is opt
    diff = torch.optim.Adam([p], differentiable=True)
    with pytest.warns(RuntimeWarning, match="differentiable"):
        assert fo.maybe_fuse(diff) is diff


def test_distributed_optimizer_accepts_fused_and_honours_env():
    """Single-rank hvd: DistributedOptimizer wraps FusedAdam like any optimizer, and
    AIAK_FUSED_OPTIMIZER=1 turns a torch.optim.Adam into FusedAdam (own process: hvd.init)."""
    script = textwrap.dedent("""
        import os, torch
        import aiak_training.torch as hvd
        from aiak_training.fused_optim import FusedAdam
        hvd.init()
        torch.manual_seed(0)
        m1 = torch.nn.Linear(6, 3); m2 = torch.nn.Linear(6, 3); m2.load_state_dict(m1.state_dict())
        o1 = hvd.DistributedOptimizer(FusedAdam(m1.parameters(), lr=0.01), named_parameters=m1.named_parameters())
        os.environ["AIAK_FUSED_OPTIMIZER"] = "1"
        o2 = hvd.DistributedOptimizer(torch.optim.Adam(m2.parameters(), lr=0.01), named_parameters=m2.named_parameters())
        assert isinstance(o1, FusedAdam) and isinstance(o2, FusedAdam), type(o2).__mro__
        m3 = torch.nn.Linear(6, 3); m3.load_state_dict(m1.state_dict())
        o3 = torch.optim.Adam(m3.parameters(), lr=0.01, foreach=False)
        x = torch.randn(5, 6)
        for _ in range(3):
            for m, o in ((m1, o1), (m2, o2), (m3, o3)):
                o.zero_grad(); m(x).pow(2).sum().backward(); o.step()
        for a, b, c in zip(m1.parameters(), m2.parameters(), m3.parameters()):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
        hvd.shutdown()
        print("OK")
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("AIAK_FUSED_OPTIMIZER", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr
