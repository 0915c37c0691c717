"""Checkpoint and restore across a process restart must continue training bit for bit.

Three 2-rank jobs (tests/scripts/checkpoint_resume.py): one trains 2K steps without
interruption; one trains K steps, writes a checkpoint and exits; a new one builds the model
and optimizer afresh, loads the checkpoint and trains the remaining K steps.  The final
weights and the optimizer state dicts of the two must be equal (``torch.equal``) on every
rank, for DGC (momentum correction, a warm-up whose stages span the checkpoint) and for the
fused optimizers, with and without ``overlap_update``.
"""
import math
import sys

import pytest
import torch

from launch import run_ranks

SCRIPT = "tests/scripts/checkpoint_resume.py"
K = 6
RANKS = 2
CONFIGS = ["dgc", "fused_adam", "fused_adamw", "fused_adamw_bcast", "fused_sgd", "fused_lamb",
           "fused_adam_overlap", "fused_sgd_overlap"]
# One completed reduction is enough for a bucket of its own, and tensors of 256 bytes or more
# are reduced (and completed) one by one, so the overlapped update is usually split.
ENV = {"AIAK_OVERLAP_MIN_BUCKET_BYTES": "1", "AIAK_ZERO_COPY_BYTES": "256"}


def _run(phase, root):
    proc = run_ranks([RANKS], [sys.executable, SCRIPT, phase, str(root), str(K)], env=ENV,
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert proc.stdout.count(f"phase {phase} done") == RANKS, proc.stdout[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint_resume")
    for phase in ("full", "first", "resume"):  # three separate jobs, fresh processes each
        _run(phase, root)
    return root


def _load(root, kind, name, rank):
    return torch.load(root / kind / f"{name}.rank{rank}.pt")


def assert_identical(a, b, where="state"):
    """Equal bit for bit: tensors by torch.equal (and dtype), containers item by item."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where}: max difference {(a - b).abs().max().item()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), \
            f"{where}: keys {sorted(a, key=str)} != {sorted(b, key=str)}"
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _differs(a, b):
    return any(not torch.equal(a[k], b[k]) for k in a)


# fused_adamw_bcast_params_first restores in Horovod's documented order (parameters, then
# optimizer state): the state created on the non-root ranks must not decay their weights.
@pytest.mark.parametrize("name", CONFIGS + ["fused_adamw_bcast_params_first"])
def test_resumed_run_is_bit_identical(runs, name):
    for rank in range(RANKS):
        full = _load(runs, "full", name, rank)
        resumed = _load(runs, "resumed", name, rank)
        assert_identical(full["model"], resumed["model"], f"rank {rank} model")
        assert_identical(full["opt"], resumed["opt"], f"rank {rank} optimizer")
        assert full["opt"]["state"], "the optimizer state must not be empty"
        # The check means something: the weights moved, and without the optimizer state
        # (from the checkpoint's weights, fresh optimizer) the run ends elsewhere.
        control = _load(runs, "control", name, rank)
        assert _differs(full["model"], control["model"]), "optimizer state made no difference"
    # Every rank ends with the same weights (the data differed between ranks).
    assert_identical(_load(runs, "full", name, 0)["model"],
                     _load(runs, "full", name, 1)["model"], "rank 0 vs rank 1")


def test_dgc_state_spans_the_checkpoint(runs):
    """The checkpoint holds live DGC state mid warm-up, different on each rank."""
    ckpts = [torch.load(runs / "ckpt" / f"dgc.rank{r}.pt") for r in range(RANKS)]
    for ck in ckpts:
        assert ck["opt"]["dgc"]["step"] == K
        entries = [s for s in ck["opt"]["state"].values() if "dgc_residual" in s]
        assert len(entries) == 2  # the two 64x64 weights
        assert all("dgc_velocity" in s and s["dgc_residual"].abs().sum() > 0 for s in entries)
        # Dense tensors (biases, the small first weight) keep SGD's momentum buffers.
        assert sum("momentum_buffer" in s for s in ck["opt"]["state"].values()) == 6
    residuals = [[s["dgc_residual"] for s in ck["opt"]["state"].values() if "dgc_residual" in s]
                 for ck in ckpts]
    assert any(not torch.equal(a, b) for a, b in zip(*residuals)), "residuals are per rank"
    # Warm-up over 8 steps in 4 stages: stage 3 (density 0.004) runs at steps 6-7, across the
    # restart; the final density (0.01) starts at step 8 < 2K.
    for rank in range(RANKS):
        full = _load(runs, "full", "dgc", rank)
        assert full["opt"]["dgc"]["step"] == 2 * K
        assert math.isclose(full["extra"]["dgc_density"], 0.01)


@pytest.mark.parametrize("name", ["fused_adam_overlap", "fused_sgd_overlap"])
def test_overlapped_runs_really_overlapped(runs, name):
    for kind, steps in (("full", 2 * K), ("resumed", K)):
        stats = _load(runs, kind, name, 0)["extra"]["overlap"]
        assert stats["overlapped_steps"] == steps, stats
        assert not stats["fallback_steps"], stats
        # At least one bucket per step; how many depends on when reductions complete.
        assert stats["buckets"] >= steps, stats
