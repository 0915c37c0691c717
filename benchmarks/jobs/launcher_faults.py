"""Per-rank program of tests/test_launcher_failures.py and benchmarks/fault_bounds.py.

``python launcher_faults.py MODE DIR [MARKER]``; every rank writes ``DIR/ready.<rank>`` (its
pid) once ``hvd.init()`` returned.  MARKER only tags the command line, so that a test can find
every process of its job.

* ``stuck``: rank 1 sleeps 45 s after ``hvd.init()``; the other ranks allreduce and exit 1 on
  the ``HorovodInternalError`` (run it with a stall shutdown).
* ``uneven``: rank 0 runs 100 steps of one allreduce each, the others 90, then all end.
* ``train``: every rank allreduces in a loop until it is stopped (at most LIMIT_S seconds).
"""
import os
import sys
import time

import torch

import aiak_training.torch as hvd

LIMIT_S = 120.0
mode, out = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
with open(os.path.join(out, f".ready.{rank}"), "w") as f:
    f.write(f"{os.getpid()}\n")
os.replace(os.path.join(out, f".ready.{rank}"), os.path.join(out, f"ready.{rank}"))

if mode == "stuck":
    if rank == 1:
        time.sleep(45)
        print("UNEXPECTED: rank 1 woke up before the job ended", flush=True)
        sys.exit(0)
    try:
        hvd.allreduce(torch.ones(3), name="never_matched")
        print(f"UNEXPECTED: rank {rank} completed without rank 1", flush=True)
    except hvd.HorovodInternalError:
        print(f"rank {rank}: HorovodInternalError", flush=True)
        sys.exit(1)
elif mode == "uneven":
    steps = 100 if rank == 0 else 90
    for step in range(steps):
        result = hvd.allreduce(torch.full((4,), float(rank + 1)), name=f"grad.{step % 3}",
                               op=hvd.Sum)
        assert result[0].item() == sum(range(1, hvd.size() + 1)), result
    print(f"rank {rank}: ran {steps} steps", flush=True)
elif mode == "train":
    t = torch.ones(1024)
    start = time.monotonic()
    while time.monotonic() - start < LIMIT_S:
        hvd.allreduce(t, name="grad")
    print(f"UNEXPECTED: rank {rank} trained for {LIMIT_S} s", flush=True)
    sys.exit(3)
else:
    raise SystemExit(f"unknown mode {mode!r}")
