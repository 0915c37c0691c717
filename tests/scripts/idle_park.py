"""Per-rank check of the idle park (AIAK_IDLE_PARK_MS) of the engine over Gloo
(csrc/engine/engine.cpp).

While no rank has anything in flight, the engine negotiates at most once per park; a thread
that waits on a handle wakes a parked engine, so operations do not wait the park out.
"""
import os
import time

import torch

import aiak_training.torch as hvd
from aiak_training.runtime.transport.gloo_calls import GlooCalls

negotiations = [0]

# The engine negotiates in C++; over Gloo each negotiation makes one allreduce call into
# GlooCalls (the bit vector), which idle cycles make and nothing else does.
_gloo_allreduce = GlooCalls.allreduce


def _counting_gloo(self, *args, **kwargs):
    negotiations[0] += 1
    return _gloo_allreduce(self, *args, **kwargs)


GlooCalls.allreduce = _counting_gloo

hvd.init()
park_s = float(os.environ["AIAK_IDLE_PARK_MS"]) / 1000.0
hvd.allreduce(torch.ones(1), name="warm-up")

# Idle: nothing submitted anywhere, so every rank's engine parks.
before, start = negotiations[0], time.monotonic()
time.sleep(1.0)
idle_cycles, idle_s = negotiations[0] - before, time.monotonic() - start
bound = idle_s / park_s + 2
assert idle_cycles <= bound, f"{idle_cycles} negotiations in {idle_s:.2f} s idle (bound {bound:.1f})"

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
assert negotiations[0] >= 11, f"only {negotiations[0]} negotiations counted"
print(f"rank {hvd.rank()}: idle negotiations {idle_cycles}, 10 allreduces in {busy_s:.3f} s",
      flush=True)
hvd.shutdown()
