"""Rank 1 SIGKILLs itself in the middle of a stream of allreduces."""
import os
import signal
import time

import torch

import aiak_training.torch as hvd

hvd.init()
t = torch.ones(1 << 16)
for step in range(100000):
    h = hvd.allreduce_async(t, name=f"loop.{step % 4}")
    if hvd.rank() == 1 and step == 20:
        print("rank 1 killing itself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        hvd.synchronize(h)
    except hvd.HorovodInternalError as exc:
        print(f"rank {hvd.rank()} got HorovodInternalError: {exc}", flush=True)
        raise SystemExit(1)
print("UNEXPECTED: loop finished", flush=True)
