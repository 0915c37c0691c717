"""Coordinator rounds whose request lists differ in size from rank to rank, and responses
longer than the coordinator's first broadcast (4 KiB): every sum checked exactly."""
import os
import time

import torch

import aiak_training.torch as hvd

GLOO = os.environ.get("HOROVOD_CONTROLLER") == "gloo"
calls = {"gather": 0, "gatherv": 0, "bcast": 0}
if GLOO:  # count the engine's coordinator collectives
    from aiak_training.runtime.transport import gloo_calls

    for kind in calls:
        def counted(self, *args, _run=getattr(gloo_calls.GlooCalls, kind), _kind=kind):
            calls[_kind] += 1
            return _run(self, *args)
        setattr(gloo_calls.GlooCalls, kind, counted)

hvd.init()
rank, size = hvd.rank(), hvd.size()
COUNT = 120
# One group lands in one cycle; its long base name makes the round's responses about 10 KiB,
# past the first broadcast.
NAME = "widths." + "n" * 60
tensors = [torch.full((i % 5 + 1,), float(rank * 1000 + i)) for i in range(COUNT)]
for attempt in range(2):  # the second pass finds every tensor in the response cache
    # Rank 0 submits at once and the others later: rounds in between carry rank 0's long
    # list and the others' empty ones.
    if rank:
        time.sleep(0.2)
    outs = hvd.synchronize(hvd.grouped_allreduce_async(tensors, name=NAME, op=hvd.Sum))
    for i, out in enumerate(outs):
        want = float(sum(r * 1000 + i for r in range(size)))
        assert out.tolist() == [want] * (i % 5 + 1), (attempt, i, out.tolist(), want)
    hvd.barrier()  # a coordinator round of one control op
if GLOO:
    # With no stall report, join or renegotiation, a round is one gather of padded lists and
    # one broadcast (two when the responses pass 4 KiB), never the sizes-first gatherv.
    assert calls["gatherv"] == 0 and calls["gather"] > 0, calls
    assert calls["gather"] < calls["bcast"] <= 2 * calls["gather"], calls
print(f"negotiation widths ok on rank {rank}", flush=True)
hvd.shutdown()
