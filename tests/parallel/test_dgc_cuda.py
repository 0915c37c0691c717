"""DGC and the overlapped update with CUDA gradients, on every rank (issue 29 parts 1-2).

Run under an MPI launcher by tests/test_dgc_cuda.py: 1 rank (NCCL) and 2 ranks sharing one
GPU (the staged path).  Skipped without a CUDA device.  The references are the CPU paths,
which tests/test_dgc*.py check against independent ones.
"""
import warnings

import pytest
import torch

import aiak_training.torch as hvd
from aiak_training.dgc import _kernels, device_select
from aiak_training.dgc.exchange import add_slots
from aiak_training.dgc.wire import pack_slots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module", autouse=True)
def device():
    index = hvd.rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def residuals(seed):
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(1 << 20, generator=g)
    ties = torch.randint(-3, 4, (1 << 17,), generator=g).float()
    nan = torch.randn(300_000, generator=g)
    nan[::5] = float("nan")
    return [(normal, 1049), (ties, 100), (nan, 300),
            (torch.randn(200_000, generator=g, dtype=torch.float64), 200),
            (torch.randn(5000, generator=g), 5), (torch.zeros(70_000), 70)]


@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_selection_equals_the_cpu_kernels(device, seed):
    cases = residuals(seed)
    xs = [x.to(device) for x, _ in cases]
    ks = [k for _, k in cases]
    torch.cuda.synchronize()
    device_select.start(xs, ks, seed=seed)  # layouts made once (one host copy each)
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing op raises
    try:
        pending = device_select.start(xs, ks, seed=seed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    slots, counts, paths = device_select.resolve(pending)
    for (x, k), s, c in zip(cases, slots, counts):
        if _kernels.native_available():
            expected, _ = _kernels.select_topk(x, k, seed=seed)
        else:
            expected, _ = _kernels.select_topk(x, k, use_native=False)
        assert s.device == xs[0].device
        assert s[:c].cpu().tolist() == expected.tolist()
    assert device_select.PATH_SAMPLED in paths


def make_opt(params, fp16):
    return hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
        named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
        compression=hvd.Compression.dgc(density=0.001, warmup_steps=4, fp16_values=fp16,
                                        min_numel=1024))


SHAPES = [(512, 256), (256, 256), (64, 32), (256,)]


@pytest.mark.parametrize("fp16", [False, True])
def test_cuda_dgc_keeps_the_cpu_bits(device, fp16):
    """The same gradients on CUDA and CPU parameters: every step sends the same pairs and
    leaves the same residual and velocity (no weight decay, so the parameters' own update,
    which may round differently on the GPU, does not feed back)."""
    runs = []
    for where in ("cpu", device):
        params = [torch.nn.Parameter(torch.zeros(s, device=where)) for s in SHAPES]
        runs.append((params, make_opt(params, fp16)))
    (cpu_params, cpu_opt), (gpu_params, gpu_opt) = runs
    for step in range(7):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        for pc, pg in zip(cpu_params, gpu_params):
            grad = torch.randn(pc.shape, generator=g)
            pc.grad, pg.grad = grad.clone(), grad.to(device)
        cpu_opt.step()
        gpu_opt.step()
        for (n0, i0, v0), (n1, i1, v1) in zip(cpu_opt.dgc_sent(), gpu_opt.dgc_sent()):
            assert n0 == n1 and torch.equal(i0, i1.cpu()) and torch.equal(v0, v1.cpu()), step
        for pc, pg in zip(cpu_params, gpu_params):
            sc, sg = cpu_opt.dgc_state(pc), gpu_opt.dgc_state(pg)
            assert sc.keys() == sg.keys()
            for key in sc:
                assert torch.equal(sc[key], sg[key].cpu()), (step, key)
            if pc.dim() > 1:  # the exchanged gradients of the compressed tensors
                assert torch.equal(pc.grad, pg.grad.cpu()), step
    assert gpu_opt.dgc_stats()["paths"].get(1, 0) >= 1


def test_cuda_compress_and_exchange_read_the_device_once(device):
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in SHAPES]
    opt = make_opt(params, False)
    for _ in range(5):  # through the warm-up: the layouts and headers are made once each
        for p in params:
            p.grad = torch.randn(p.shape, device=device)
        opt.step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # every synchronizing op warns
        try:
            indices, values, _, _ = opt._dgc_compress_all(opt.dgc_density())
            buf = pack_slots(indices, values, opt._dgc_header(indices))
            outs = [torch.zeros(p.numel(), device=device) for p in opt._dgc_sparse]
            add_slots(buf, 1, outs, [int(i.numel()) for i in indices],
                      [v.dtype for v in values])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]  # the counts, once


@pytest.mark.parametrize("name", ["sgd", "adam_fused", "fused_adam"])
def test_cuda_overlapped_update_is_bitwise_the_synchronous_one(device, name):
    from aiak_training.fused_optim import FusedAdam
    makers = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
              "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
              "fused_adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=1e-3)}
    models = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(device)
        opt = hvd.DistributedOptimizer(makers[name](model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       overlap_update=overlap)
        for step in range(6):
            g = torch.Generator().manual_seed(100 * step + hvd.rank())
            x = torch.randn(8, 64, generator=g).to(device)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        models.append((model, opt))
    (m0, _), (m1, o1) = models
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    if hvd.size() > 1:
        assert o1.overlap_stats()["overlapped_steps"] == 6


def test_dgc_parameter_on_another_gpu_is_refused(device):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    other = (device.index + 1) % torch.cuda.device_count()
    p = torch.nn.Parameter(torch.zeros(64, 64, device=torch.device("cuda", other)))
    with pytest.raises(ValueError, match=f"on cuda:{other}, but this rank uses"):
        make_opt([p], False)
