"""Per-rank check: rank 0 submits a tensor as GPU memory and the other ranks submit host
memory under the same name.  The C++ engine's negotiation must fail it on every rank with
Horovod's "Mismatched ... CPU/GPU device selection" error, before anything touches the memory,
so this runs without a GPU; the engine stays usable afterwards."""
import numpy as np
import torch

import aiak_training.torch as hvd
from aiak_training.common.dtypes import DataType
from aiak_training.common.exceptions import HorovodInternalError
from aiak_training.common.messages import OpType, Request
from aiak_training.runtime import current
from aiak_training.runtime.entries import TensorEntry

hvd.init()
engine = current.engine()
buf = np.ones(4, dtype=np.float32)
device = 0 if hvd.rank() == 0 else -1
req = Request(hvd.rank(), "t", OpType.ALLREDUCE, int(DataType.FLOAT32), (4,), device=device)
entry = TensorEntry("t", DataType.FLOAT32, (4,), buf.ctypes.data, buf.ctypes.data, keep=buf,
                    device=device)
(handle,) = engine.enqueue(0, [req], [entry])
try:
    engine.wait(handle)
    raise SystemExit("UNEXPECTED: the mismatched allreduce completed")
except HorovodInternalError as exc:
    message = str(exc)
assert "CPU/GPU device selection" in message and "tensor t" in message, message
assert buf.tolist() == [1.0] * 4, buf  # refused before any data moved
out = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="after")
assert out.tolist() == [float(hvd.size())] * 3, out
print(f"rank {hvd.rank()}: device mismatch refused", flush=True)
hvd.shutdown()
