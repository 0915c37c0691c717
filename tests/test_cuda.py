"""CUDA tensors end to end, launched at several layouts.  Needs a GPU; skipped without one.

* 1 rank: NCCL (every collective, dtype and op).
* 2 and 4 ranks on one GPU: NCCL refuses ranks that share a GPU, so the engine agrees on the
  staged MPI path by itself.
* 2 ranks with AIAK_GPU_TRANSPORT=mpi: the staged path when asked for.
* With 2+ (4+) GPUs: 2 ranks (2 virtual nodes x 2 ranks, hierarchical) on NCCL.
"""
import sys

import pytest
import torch

from launch import check_rank_summaries, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (torch.cuda.is_available() is False)")

SUITE = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "--rootdir", "tests/parallel", "tests/parallel/test_cuda_ops.py"]
ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}


def expect(transport, **env):
    return dict(env, AIAK_TEST_GPU_TRANSPORT=transport)


LAYOUTS = {
    "1rank_nccl": ([1], False, expect("nccl"), 1),
    "2ranks_one_gpu_staged": ([2], False, expect("mpi", **ONE_GPU), 1),
    "4ranks_one_gpu_staged": ([4], False, expect("mpi", **ONE_GPU), 1),
    "2ranks_mpi_asked_for": ([2], False, expect("mpi", AIAK_GPU_TRANSPORT="mpi"), 1),
    "2ranks_two_gpus_nccl": ([2], False, expect("nccl"), 2),
    # Small chunks: many pipeline steps over three communicators and two streams.
    "2x2_virtual_nodes_hier_nccl": ([2, 2], True, expect(
        "nccl+hier", HOROVOD_HIERARCHICAL_ALLREDUCE="1", AIAK_TEST_LAYOUT="2,2",
        AIAK_HIER_GPU_CHUNK_BYTES="65536"), 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_suite(layout):
    nodes, virtual, env, gpus = LAYOUTS[layout]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, found {torch.cuda.device_count()}")
    proc = run_ranks(nodes, SUITE, env=env, virtual_hosts=virtual)
    assert proc.returncode == 0, proc.stdout[-6000:]
    # tests/parallel/test_cuda_ops.py's 165 tests, less the mismatch test at one rank.
    check_rank_summaries(proc.stdout, sum(nodes), 165 if sum(nodes) > 1 else 164)


def test_batched_copy_kernel_copies_exactly():
    """The fusion buffer's copy kernel, against torch: odd sizes, unaligned addresses (the
    byte path), zero sizes, and more than one launch's worth (64) of buffers."""
    from aiak_training.common.gpu import kernels
    if kernels.library() is None:
        pytest.skip(f"CUDA kernel library not built: {kernels.error()}")
    torch.manual_seed(0)
    sizes = [0, 1, 3, 15, 16, 17, 4096, 4097, 1 << 20, (1 << 20) + 5] * 8  # 80 buffers
    # One buffer larger than its run of blocks covers in one pass (the stride loop), among
    # small ones that get a single block each.
    sizes[13] = (40 << 20) + 3
    room = sum(sizes) + 40 * len(sizes)
    src = torch.randint(0, 256, (room,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(room, dtype=torch.uint8, device="cuda")
    expected = torch.zeros_like(dst)
    srcs, dsts, off = [], [], 0
    for i, n in enumerate(sizes):
        # Every third buffer is 16-byte aligned at both ends (the vector path, then the byte
        # tail when n % 16 != 0); the others start off the grid (the byte path).
        off = (off + 15) // 16 * 16
        s, d = off + i % 3, off + (i % 3 != 0) * (i % 2 + 1)
        srcs.append(src.data_ptr() + s)
        dsts.append(dst.data_ptr() + d)
        expected[d:d + n] = src[s:s + n]
        off += n + 4  # windows never touch
    stream = torch.cuda.current_stream()
    kernels.batched_copy(dsts, srcs, sizes, int(stream.cuda_stream))
    stream.synchronize()
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("ranks", [1, 2])
def test_main_job_trains_on_cuda(ranks):
    """examples/pytorch_digits.py --cuda: a real training run with CUDA gradients (2 ranks
    share GPU 0 where there is only one, which takes the staged path)."""
    env = ONE_GPU if torch.cuda.device_count() < ranks else {}
    proc = run_ranks([ranks], [sys.executable, "examples/pytorch_digits.py", "--cuda",
                               "--epochs", "8"], env=env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    accuracy = float(proc.stdout.rsplit("test accuracy: ", 1)[1].split("%")[0])
    assert accuracy > 90.0, proc.stdout[-2000:]
