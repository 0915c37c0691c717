"""Every API call before hvd.init() raises a clear ValueError."""
import torch

import aiak_training.torch as hvd

for call in (hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank,
             hvd.cross_size, lambda: hvd.allreduce(torch.ones(1)), hvd.barrier,
             lambda: hvd.broadcast_object(1)):
    try:
        call()
    except ValueError as exc:
        assert "Horovod has not been initialized; use hvd.init()." in str(exc), exc
    else:
        raise AssertionError(f"{call} did not raise")
assert not hvd.is_initialized()
hvd.init()
assert hvd.is_initialized() and hvd.size() == 1
hvd.shutdown()
assert not hvd.is_initialized()
try:
    hvd.size()
except ValueError:
    pass
else:
    raise AssertionError("size() after shutdown did not raise")
hvd.init()  # init -> shutdown -> init works
assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [1.0, 1.0]
print("before-init checks passed")
