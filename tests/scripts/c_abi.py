"""The engine's C ABI (aiak_engine_enqueue / _wait / _poll), called through ctypes as
a non-Python frontend would call it, beside the Python API on the same engine.

Every rank prints "c abi checks passed" at the end; any failed check raises.
"""
import ctypes

import numpy as np
import torch

import aiak_training._native as native_module
import aiak_training.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
lib = ctypes.CDLL(native_module.__file__)
lib.aiak_engine_enqueue.restype = ctypes.c_int64
lib.aiak_engine_enqueue.argtypes = [
    ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32,
    ctypes.POINTER(ctypes.c_int64), ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_int32, ctypes.c_double, ctypes.c_double, ctypes.c_int32, ctypes.c_char_p,
    ctypes.c_size_t]
lib.aiak_engine_wait.restype = ctypes.c_int
lib.aiak_engine_wait.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t]
lib.aiak_engine_poll.restype = ctypes.c_int
lib.aiak_engine_poll.argtypes = [ctypes.c_int64]

ALLREDUCE, BROADCAST = 0, 2
FLOAT32, INT64, FLOAT64 = 7, 5, 8
AVERAGE, SUM, MAX = 0, 1, 4
err = ctypes.create_string_buffer(512)


def enqueue(op, name, dtype, arr, out, reduce_op=SUM, pre=1.0, post=1.0, root=-1):
    shape = (ctypes.c_int64 * arr.ndim)(*arr.shape)
    return lib.aiak_engine_enqueue(0, op, name.encode(), dtype, shape, arr.ndim,
                                   arr.ctypes.data, out.ctypes.data, reduce_op, pre, post, root,
                                   err, len(err))


def wait(handle):
    code = lib.aiak_engine_wait(handle, err, len(err))
    assert code == 0, (code, err.value)


# Several in flight at once, fused by the engine like any other submission.
inputs = [np.arange(6, dtype=np.float32).reshape(2, 3) * (rank + 1) + i for i in range(5)]
outputs = [np.empty_like(a) for a in inputs]
handles = [enqueue(ALLREDUCE, f"c.sum.{i}", FLOAT32, a, o) for i, (a, o) in
           enumerate(zip(inputs, outputs))]
assert all(h > 0 for h in handles), err.value
for h in handles:
    wait(h)
ranks_sum = size * (size + 1) // 2
for i, o in enumerate(outputs):
    expect = np.arange(6, dtype=np.float32).reshape(2, 3) * ranks_sum + i * size
    assert np.array_equal(o, expect), (i, o, expect)

# Average with scale factors, float64, in place.
buf = np.full(7, float(rank + 1))
h = enqueue(ALLREDUCE, "c.avg", FLOAT64, buf, buf, AVERAGE, 2.0, 0.5)
wait(h)
assert np.array_equal(buf, np.full(7, 2.0 * ranks_sum / size * 0.5)), buf

# Max of int64, and a broadcast from the last rank.
ints = np.array([rank, -rank, 10 * rank], dtype=np.int64)
out = np.empty_like(ints)
wait(enqueue(ALLREDUCE, "c.max", INT64, ints, out, MAX))
assert out.tolist() == [size - 1, 0, 10 * (size - 1)], out
data = np.full(4, float(rank), dtype=np.float32)
wait(enqueue(BROADCAST, "c.bcast", FLOAT32, data, data, root=size - 1))
assert np.array_equal(data, np.full(4, float(size - 1), dtype=np.float32)), data

# The Python API and the C ABI share the engine: a Python op in between works as usual.
t = hvd.allreduce(torch.ones(3) * rank, op=hvd.Sum, name="py.between")
assert torch.equal(t, torch.full((3,), float(sum(range(size)))))

# Errors come back as codes with a message, never as a hang.
assert lib.aiak_engine_wait(123456789, err, len(err)) == -1
assert lib.aiak_engine_poll(123456789) == -1
bad = np.zeros(2, dtype=np.float32)
assert enqueue(3, "c.alltoall", FLOAT32, bad, bad) == -1 and b"allreduce (0) and broadcast (2)" in err.value
assert enqueue(ALLREDUCE, "c.dtype", 99, bad, bad) == -1 and b"dtype" in err.value
h = enqueue(ALLREDUCE, "c.dup", FLOAT32, bad, bad)
assert enqueue(ALLREDUCE, "c.dup", FLOAT32, bad, bad) == -1 and b"same name" in err.value
wait(h)
# A mismatch negotiated across ranks fails the handle on every rank, with the reason.
mismatched = np.zeros(2 + rank, dtype=np.float32)
h = enqueue(ALLREDUCE, "c.mismatch", FLOAT32, mismatched, mismatched)
if size > 1:
    assert lib.aiak_engine_wait(h, err, len(err)) == 1
    assert b"Mismatched allreduce tensor shapes" in err.value, err.value
else:
    wait(h)
hvd.shutdown()
# After shutdown the C ABI refuses instead of touching a stopped engine.
assert enqueue(ALLREDUCE, "c.after", FLOAT32, bad, bad) == -1 and b"not running" in err.value
print("c abi checks passed", flush=True)
