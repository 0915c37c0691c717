"""Per-rank training-like loop for the autotune tests (tests/test_autotune.py).

Each step allreduces the same named tensors (a step, as autotune finds it) with values that
sum exactly, checks every result, and records the setting in force after the step.  Writes
``<out>/rank<N>.json``: the settings per step, whether tuning was still on (the engine still
holds a tuner), how many times the engine had called the tuner by then, and the step count.
Usage: autotune_job.py OUT_DIR STEPS
"""
import json
import os
import sys

import torch

import aiak_training.torch as hvd
from aiak_training.runtime import autotune, current
from aiak_training.runtime.autotune.tuner import Autotuner

# Count the engine's calls into the tuner (its hot-path hook): none may follow the end of tuning.
tuner_calls = 0
_on_allreduce = Autotuner.on_allreduce


def _counted(self, name):
    global tuner_calls
    tuner_calls += 1
    _on_allreduce(self, name)


Autotuner.on_allreduce = _counted
out_dir, steps = sys.argv[1], int(sys.argv[2])
hvd.init()
rank, size = hvd.rank(), hvd.size()
# Sizes from 64 B to 256 KB, so that the fusion threshold changes how they are packed.
sizes = [16, 4096, 300, 65536, 1000, 7, 20000, 128]
ranks_sum = size * (size + 1) // 2
records = []
for step in range(steps):
    tensors = [torch.full((n,), float((rank + 1) * (i + 1) * (step % 7 + 1)))
               for i, n in enumerate(sizes)]
    handles = [hvd.allreduce_async(t, name=f"grad.{i}", op=hvd.Sum)
               for i, t in enumerate(tensors)]
    # The setting this step's tensors run under (a switch happens as the first is submitted).
    records.append(dict(autotune.setting_in_force(), tuning=autotune.tuning(),
                        tuner_calls=tuner_calls))
    for i, (n, handle) in enumerate(zip(sizes, handles)):
        got = hvd.synchronize(handle)
        expected = float(ranks_sum * (i + 1) * (step % 7 + 1))
        assert torch.equal(got, torch.full((n,), expected)), (rank, step, i, got[:4])
    # What the engine's cache holds once the step is done: nothing while autotune has it off.
    records[-1]["cache_entries"] = current.engine().counts()["cache_entries"]
# No rank shuts down (which stops every rank's engine) before the last one has read its counts.
hvd.barrier()
hvd.shutdown()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
    json.dump({"steps": steps, "records": records}, fh)
print(f"rank {rank}: {steps} steps exact", flush=True)
