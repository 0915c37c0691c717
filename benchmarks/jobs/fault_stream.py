"""Per-rank program of the fault tests (tests/test_faults.py) and benchmarks/fault_bounds.py.

``stream DIR``: a stream of allreduces until something fails (at most LIMIT_S seconds).
``stall DIR``: rank 3 never calls a collective; the others wait in one allreduce.
``big DIR MIB COUNT``: COUNT allreduces of MIB MiB each (slow on an impaired link), exact
results checked; rank 0 prints ``BIG op I: S s``.
Each rank writes ``DIR/pid.<rank>`` (its pid and host) at start and ``DIR/ready.<rank>`` once
its collectives run, so that the test knows when to inject the fault and whom to watch.
"""
import os
import socket
import sys
import time

import torch

import aiak_training.torch as hvd

LIMIT_S = 120.0
mode, out = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
with open(os.path.join(out, f"pid.{rank}"), "w") as f:
    f.write(f"{os.getpid()} {socket.gethostname()}\n")


def ready() -> None:
    open(os.path.join(out, f"ready.{rank}"), "w").close()


start = time.monotonic()
if mode == "stream":
    t = torch.ones(1 << 14)
    step = 0
    while time.monotonic() - start < LIMIT_S:
        try:
            out_t = hvd.allreduce(t, name=f"stream.{step % 4}", op=hvd.Sum)
        except hvd.HorovodInternalError as exc:
            print(f"rank {rank} got HorovodInternalError after step {step}: {exc}", flush=True)
            raise SystemExit(1)
        assert out_t[0].item() == hvd.size()
        step += 1
        if step == 50:
            ready()
    print(f"UNEXPECTED: rank {rank} streamed for {LIMIT_S} s without a failure", flush=True)
    raise SystemExit(3)
elif mode == "stall":
    ready()
    if rank == 3:
        time.sleep(LIMIT_S)  # never calls a collective; the job must end without it
        print("UNEXPECTED: rank 3 outlived the stall shutdown", flush=True)
        raise SystemExit(3)
    try:
        hvd.allreduce(torch.ones(3), name="waits_for_rank_3")
        print(f"UNEXPECTED: rank {rank} completed without rank 3", flush=True)
    except hvd.HorovodInternalError as exc:
        print(f"rank {rank}: stall shutdown raised HorovodInternalError: {exc}", flush=True)
    raise SystemExit(1)
elif mode == "big":
    mib, count = int(sys.argv[3]), int(sys.argv[4])
    t = torch.full((mib * (1 << 20) // 4,), float(rank + 1))
    expected = float(sum(range(1, hvd.size() + 1)))
    ready()
    for i in range(count):
        began = time.monotonic()
        out_t = hvd.allreduce(t, name=f"big.{i}", op=hvd.Sum)
        assert bool((out_t == expected).all()), i
        if rank == 0:
            print(f"BIG op {i}: {time.monotonic() - began:.1f} s", flush=True)
else:
    raise SystemExit(f"unknown mode {mode!r}")
