"""CUDA side of the fused optimizers.

* The compile check (CI has nvcc but no GPU): when nvcc is on PATH and the kernels were asked
  for (a visible GPU, or AIAK_CUDA_ARCHS as the README's test command sets it), setup.py must
  have built aiak_training/lib/libaiak_fused_cuda.so with the C entry points and SASS for
  sm_80/sm_90.
* Numerical tests on a GPU against torch.optim, skipped when there is no CUDA device.
"""
import ctypes
import os
import shutil
import subprocess

import pytest
import torch

import aiak_training.fused_optim as fo
from aiak_training.fused_optim import _backend as B

HAS_GPU = torch.cuda.is_available()
# setup.py builds the kernels only where a GPU is visible or AIAK_CUDA_ARCHS asks for them.
KERNELS_WANTED = shutil.which("nvcc") is not None and (HAS_GPU or bool(os.environ.get("AIAK_CUDA_ARCHS")))
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device (torch.cuda.is_available() is False)")


# --------------------------------------------------------------------------- compile check
needs_kernels = pytest.mark.skipif(not KERNELS_WANTED, reason="nvcc not on PATH, or no GPU and AIAK_CUDA_ARCHS unset: the CUDA kernels are not built")


def assert_no_torch_link(path):
    """One build for every torch version: nothing of torch's (libtorch*, libc10*) is linked.
    Library names only: ldd's load addresses are hex and may contain "c10"."""
    deps = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    libs = [line.split()[0] for line in deps.splitlines() if line.strip()]
    assert not [lib for lib in libs if "torch" in lib or "c10" in lib], deps


@needs_kernels
def test_cuda_library_built_with_expected_symbols():
    path = fo.cuda_library_path()
    assert os.path.exists(path), (
        f"{path} missing although nvcc is on PATH; run `AIAK_CUDA_ARCHS=\"80;90\" python setup.py build_ext --inplace` "
        "and look for 'building the CUDA kernels failed'")
    lib = ctypes.CDLL(path)  # loads without a GPU or driver: the CUDA runtime is static
    for name in B.CUDA_SYMBOLS:
        assert hasattr(lib, name), f"{name} not exported by {path}"
    lib.aiak_fused_cuda_abi_version.restype = ctypes.c_int
    assert lib.aiak_fused_cuda_abi_version() == B.CUDA_ABI_VERSION
    assert fo.cuda_lib() is not None, fo.cuda_lib_error()
    # Bad arguments are rejected before anything touches a device.
    lib.aiak_fused_cuda_last_error.restype = ctypes.c_char_p
    def adam(n, dtype):
        zero = ctypes.c_double(0)
        return lib.aiak_fused_adam_cuda(n, None, None, None, None, None, None, None, None, dtype,
                                        zero, zero, zero, zero, zero, 0, 0, 0, None, None, None)
    assert adam(1, B.DTYPE_CODES[torch.float32]) != 0
    assert b"numels" in lib.aiak_fused_cuda_last_error()
    # The shared DataType codes: the four float types are accepted (no tensors: nothing to
    # do), every other code (uint8, int32, bool, ...) is refused.
    for dtype in range(12):
        rc = adam(0, dtype)
        assert (rc == 0) == (dtype in B.DTYPE_CODES.values()), dtype
        if rc:
            assert b"dtype" in lib.aiak_fused_cuda_last_error()
    # The library must not link torch (one build for every torch version).
    assert_no_torch_link(path)
    # SASS for both target architectures is embedded.
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:
        elf = subprocess.run([cuobjdump, "--list-elf", path], capture_output=True, text=True).stdout
        assert "sm_80" in elf and "sm_90" in elf, elf
    else:  # the fatbin's cubin headers name their architecture
        with open(path, "rb") as f:
            blob = f.read()
        assert b"sm_80" in blob and b"sm_90" in blob


@needs_kernels
@pytest.mark.parametrize("numels,launches", [
    ([], 0),
    ([0, 0], 0),
    ([1], 1),
    ([10] * 500, 4),                        # 160 tensors per launch
    ([65536 * 1280 + 5], 2),                # 1281 chunks: the tensor is carried into launch 2
    ([3, 65536 * 3000, 0, 7, 65537], 3),    # carry-over twice, then small tensors
    ([65536] * 159 + [65536 * 1200] + [1] * 3, 2),
])
def test_cuda_launch_packing_covers_every_chunk_once(numels, launches):
    """Host-side multi-tensor-apply packing (no GPU needed): every chunk exactly once."""
    lib = fo.cuda_lib()
    assert lib is not None, fo.cuda_lib_error()
    assert lib.aiak_fused_cuda_plan_check(len(numels), B.int64_array(numels)) == launches


def test_cpu_extension_does_not_link_torch():
    if B.cpu_ext is None:
        pytest.skip("CPU extension not built")
    assert_no_torch_link(B.cpu_ext.__file__)


# ------------------------------------------------------------------------------ GPU tests
SHAPES = [(0,), (1,), (7,), (33,), (5, 19), (3, 4, 5, 6), (70_001,), (200_003,)]


def _params(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in SHAPES]


def _grads(dtype, device, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in SHAPES]
            for _ in range(steps)]


def _compare(make_ours, make_ref, dtype, steps=4):
    """Fused optimizer on CUDA `dtype` params vs torch.optim on fp32 CPU copies (rounded to
    `dtype` after each step for bf16/fp16, as the fused path does)."""
    init = _params(dtype, "cpu")
    ours = [p.cuda().requires_grad_() for p in init]
    rd = torch.float64 if dtype == torch.float64 else torch.float32
    refs = [p.to(rd).requires_grad_() for p in init]
    opt, ref = make_ours(ours), make_ref(refs)
    for gs in _grads(dtype, "cpu", steps):
        for p, r, g in zip(ours, refs, gs):
            p.grad = g.cuda()
            r.grad = g.to(rd)
        opt.step()
        ref.step()
        if dtype in (torch.bfloat16, torch.float16):
            with torch.no_grad():
                for r in refs:
                    r.copy_(r.to(dtype).to(rd))
    torch.cuda.synchronize()
    if dtype == torch.float32:
        t = dict(rtol=1e-6, atol=1e-6)
    elif dtype == torch.float64:
        t = dict(rtol=1e-12, atol=1e-12)
    else:
        t = dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-4)
    for p, r in zip(ours, refs):
        torch.testing.assert_close(p.cpu(), r.to(dtype), **t)
        if "step" in ref.state[r]:
            assert float(opt.state[p]["step"]) == steps
            assert opt.state[p]["step"].device.type == "cuda"
    return ours, opt


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad,maximize,wd,decoupled", [
    (False, False, 0.0, False), (True, False, 0.1, False), (False, True, 0.1, True), (True, True, 0.01, True)])
def test_cuda_adam_matches_torch(dtype, amsgrad, maximize, wd, decoupled):
    assert fo.cuda_lib() is not None, fo.cuda_lib_error()
    kw = dict(lr=1e-2, weight_decay=wd, amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled)
    _compare(lambda ps: fo.FusedAdam(ps, **kw), lambda ps: torch.optim.Adam(ps, foreach=False, **kw), dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("momentum,dampening,nesterov,wd", [
    (0.0, 0.0, False, 0.0), (0.9, 0.0, True, 0.01), (0.9, 0.2, False, 0.0)])
def test_cuda_sgd_matches_torch(dtype, momentum, dampening, nesterov, wd):
    kw = dict(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd)
    _compare(lambda ps: fo.FusedSGD(ps, **kw), lambda ps: torch.optim.SGD(ps, foreach=False, **kw), dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_lamb_matches_cpu(dtype):
    """The CUDA LAMB kernels agree with the (separately tested) CPU kernels."""
    results = []
    for device in ("cpu", "cuda"):
        ps = [p.to(device).requires_grad_() for p in _params(dtype, "cpu")]
        opt = fo.FusedLAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
        for gs in _grads(dtype, "cpu", 3):
            for p, g in zip(ps, gs):
                p.grad = g.to(device)
            opt.step()
        results.append([p.detach().cpu().double() for p in ps])
    t = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-4)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, **t)


@needs_gpu
def test_cuda_found_inf_and_grad_scale_on_device():
    ps = [p.cuda().requires_grad_() for p in _params(torch.float32, "cpu")]
    opt = fo.FusedAdam(ps, lr=1e-2, amsgrad=True)
    for p, g in zip(ps, _grads(torch.float32, "cuda", 1)[0]):
        p.grad = g
    opt.step()
    snap = [p.detach().clone() for p in ps] + [t.clone() for p in ps for t in opt.state[p].values()]
    opt.found_inf = torch.ones((), device="cuda")
    opt.grad_scale = torch.full((), 4.0, device="cuda")
    opt.step()
    torch.cuda.synchronize()
    after = [p.detach().clone() for p in ps] + [t.clone() for p in ps for t in opt.state[p].values()]
    assert all(torch.equal(a, b) for a, b in zip(snap, after))


@needs_gpu
def test_cuda_state_dict_to_torch_and_back():
    ps = [p.cuda().requires_grad_() for p in _params(torch.float32, "cpu")]
    opt = fo.FusedAdamW(ps, lr=1e-2)
    for gs in _grads(torch.float32, "cuda", 2):
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
    t = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in ps], lr=1e-2)
    t.load_state_dict(opt.state_dict())
    back = fo.FusedAdamW([p.detach().clone().requires_grad_() for p in ps], lr=1e-2)
    back.load_state_dict(t.state_dict())
    for st in back.state.values():
        assert st["step"].device.type == "cuda" and float(st["step"]) == 2


@needs_gpu
def test_cuda_mixed_devices_rejected():
    with pytest.raises(ValueError, match="same device"):
        fo.FusedAdam([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="cuda"))])
