"""Per-rank program of tests/test_deadlock.py and benchmarks/deadlock_bench.py.

``python deadlock.py MODE DIR [MARKER]``; every rank writes ``DIR/ready.<rank>`` once
``hvd.init()`` returned.  MARKER only tags the command line (so a test finds every process
of its job).  ``T`` below is HOROVOD_STALL_CHECK_TIME_SECONDS.

* ``helper``: the mistake of issue 40: with ``shard_optimizer_state=True``, rank 0 calls
  ``consolidate_state_dict()`` under ``if hvd.rank() == 0:`` while rank 1 goes on to the
  next allreduce.  Each rank prints how long it waited, and the CPU its process used
  meanwhile (all threads, the engine's included), then re-raises the error.
* ``late``: rank 1 computes for 3 T before its allreduce, which rank 0 waits in: not a
  deadlock, the job ends normally with exact results.
* ``helper_late``: rank 1 computes for 3 T before it calls ``consolidate_state_dict()``,
  which rank 0 waits in: stall warnings that name the helper, then a normal end.
* ``join``: uneven data: rank 0 runs one step and joins; rank 1 runs steps that compute for
  T each, for more than 3 T in all, then joins.  Exact sums, join's result, a normal end.
"""
import json
import os
import sys
import time

import torch

import aiak_training.torch as hvd

mode, out = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
T = float(os.environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", "60"))
with open(os.path.join(out, f".ready.{rank}"), "w") as f:
    f.write(f"{os.getpid()}\n")
os.replace(os.path.join(out, f".ready.{rank}"), os.path.join(out, f"ready.{rank}"))


def compute_for(seconds: float) -> None:
    """Real work on this rank's cores (not a sleep) for ``seconds``."""
    a = torch.randn(128, 128)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def sharded_optimizer() -> hvd.DistributedOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   shard_optimizer_state=True)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
    return opt


if mode == "helper":
    opt = sharded_optimizer()
    wall, cpu = time.monotonic(), time.process_time()
    try:
        if rank == 0:
            opt.consolidate_state_dict()   # the mistake: a collective on rank 0 only
        hvd.allreduce(torch.ones(1), name="after_checkpoint")
        print(f"UNEXPECTED: rank {rank} went on", flush=True)
    except hvd.HorovodInternalError as exc:
        waited, used = time.monotonic() - wall, time.process_time() - cpu
        record = {"rank": rank, "waited_s": waited, "cpu_s": used, "error": type(exc).__name__}
        with open(os.path.join(out, f"waited.{rank}.json"), "w") as f:
            json.dump(record, f)
        print(f"rank {rank}: {type(exc).__name__} after {waited:.2f} s, cpu {used:.3f} s",
              flush=True)
        raise
elif mode == "helper_late":
    opt = sharded_optimizer()
    if rank == 1:
        compute_for(3 * T)
    state = opt.consolidate_state_dict()
    assert sorted(state["state"]) == [0, 1] and "exp_avg" in state["state"][0], state
    print(f"rank {rank}: consolidated", flush=True)
elif mode == "late":
    if rank == 1:
        compute_for(3 * T)
    result = hvd.allreduce(torch.full((3,), float(rank + 1)), op=hvd.Sum, name="late")
    assert torch.equal(result, torch.full((3,), 3.0)), result
    print(f"rank {rank}: late allreduce exact", flush=True)
elif mode == "join":
    steps = 1 if rank == 0 else 4
    for step in range(steps):
        if rank == 1:
            compute_for(T)
        result = hvd.allreduce(torch.full((2,), float(rank + 1)), op=hvd.Sum, name=f"g{step}")
        # Rank 0 joined after its first step: it then contributes zeros.
        assert result.tolist() == ([3.0, 3.0] if step == 0 else [2.0, 2.0]), (step, result)
    last = hvd.join()
    assert last == 1, last
    print(f"rank {rank}: joined after {steps} steps, last joined {last}", flush=True)
else:
    raise SystemExit(f"unknown mode {mode!r}")
