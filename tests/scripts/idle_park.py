"""Per-rank check of the engine's idle park (AIAK_IDLE_PARK_MS, csrc/engine/engine.cpp),
over MPI or Gloo.

While no rank has anything in flight, the engine negotiates at most once per park.  A
submission wakes a parked engine, and so does a thread that waits on a handle: operations do
not wait the park out.
"""
import os
import time

import torch

import aiak_training.torch as hvd
from aiak_training.runtime import current

hvd.init()
core = current.engine().core


def negotiations() -> int:
    return core.progress_counters()["negotiations"]


park_s = float(os.environ["AIAK_IDLE_PARK_MS"]) / 1000.0
hvd.allreduce(torch.ones(1), name="warm-up")

# Idle: nothing submitted anywhere, so every rank's engine parks.
before, start = negotiations(), time.monotonic()
time.sleep(1.0)
idle_cycles, idle_s = negotiations() - before, time.monotonic() - start
bound = idle_s / park_s + 2
assert idle_cycles <= bound, f"{idle_cycles} negotiations in {idle_s:.2f} s idle (bound {bound:.1f})"

# A submission wakes the parked engines: the allreduce completes while this thread sleeps,
# well before the park would end, with no thread waiting on it.
hvd.barrier()
time.sleep(0.2)
handle = hvd.allreduce_async(torch.full((3,), float(hvd.rank())), op=hvd.Sum, name="async")
time.sleep(min(0.5, park_s / 4))
assert hvd.poll(handle), "a submission did not wake the parked engine"
assert hvd.synchronize(handle).tolist() == [float(sum(range(hvd.size())))] * 3

# Busy: each allreduce's wait wakes the parked engines; without the wake-up each one would
# take about a park.
start = time.monotonic()
for i in range(10):
    out = hvd.allreduce(torch.full((3,), float(hvd.rank() + i)), op=hvd.Sum, name=f"op{i}")
    expected = float(sum(r + i for r in range(hvd.size())))
    assert out.tolist() == [expected] * 3, (i, out.tolist())
busy_s = time.monotonic() - start
assert busy_s < 2 * park_s, f"10 allreduces took {busy_s:.2f} s with a {park_s:.1f} s park"
# The counter is live for the engine under test: the allreduces above were negotiated.
assert negotiations() >= 11, f"only {negotiations()} negotiations counted"
print(f"rank {hvd.rank()}: idle negotiations {idle_cycles}, 10 allreduces in {busy_s:.3f} s",
      flush=True)
hvd.shutdown()
