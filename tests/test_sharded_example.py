"""examples/pytorch_sharded_memory_cap.py, launched on 2 ranks: under the memory cap it sets
(RLIMIT_DATA), Adam with sharded state trains and the dense DistributedOptimizer fails.

2 ranks is the hard case: a sharded rank then needs 16/2 = 8 bytes a parameter above the model
against dense's 12, which fits the cap only because the full gradients are freed as their
buckets are reduced and at most a few buckets are in flight (docs/sharded-optimizer.md,
"Memory arithmetic").
"""
import re
import sys

from launch import run_ranks

EXAMPLE = "examples/pytorch_sharded_memory_cap.py"
RANKS = 2


def test_sharded_adam_trains_under_the_cap():
    proc = run_ranks([RANKS], [sys.executable, EXAMPLE], timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    assert re.search(rf"sharded Adam on {RANKS} rank\(s\), 33\.6M parameters; memory cap "
                     r"\d+ MiB per rank", out), out[-4000:]
    losses = [float(v) for v in re.findall(r"step +\d+ loss ([\d.]+)", out)]
    assert len(losses) == 6, out[-4000:]
    # Every rank fits its own fixed batch with a small learning rate: each step lowers the
    # mean loss.
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert "done: 6 steps under the cap" in out
    assert "hit the memory cap" not in out


def test_dense_adam_hits_the_same_cap():
    proc = run_ranks([RANKS], [sys.executable, EXAMPLE, "--dense"], timeout=600)
    out = proc.stdout
    assert proc.returncode != 0, out[-4000:]
    found = re.search(r"rank \d: dense training hit the memory cap of \d+ MiB \(RLIMIT_DATA\) "
                      r"at step \d+: .*can't allocate memory", out)
    assert found, out[-4000:]
    assert "done:" not in out
