"""Stall inspector: one rank submits late ('warn') or never ('shutdown')."""
import sys
import time

import torch

import aiak_training.torch as hvd

mode = sys.argv[1]
hvd.init()
if mode == "warn":
    if hvd.rank() == 1:
        time.sleep(3.5)
    out = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="stalled")
    assert torch.equal(out, torch.full((3,), float(hvd.size())))
else:
    name = "stalled" if hvd.rank() == 0 else "never_matched"
    try:
        hvd.allreduce(torch.ones(3), name=name)
        print("UNEXPECTED: completed")
    except hvd.HorovodInternalError:
        # As in Horovod, the layout stays known after the job was shut down.
        assert (hvd.size(), hvd.local_size()) == (2, 2) and hvd.rank() in (0, 1)
        print("stall shutdown raised HorovodInternalError", flush=True)
