"""Host-memory stand-ins for libcudart and NCCL, to run the GPU executor's logic without a GPU.

``FakeRuntime``: "device memory" is host memory, a stream runs work at once (so every
ordering is trivially satisfied; stream ordering itself is tested on a real GPU only).
``FakeLibrary`` / ``FakeCommunicator``: NCCL's semantics over MPI, including in-place
reduce-scatter and allgather, ncclAvg, pre-multiplied sums and deferred groups, so that
wrong offsets, counts or units in the executor give wrong numbers here.

These test the engine's control logic (fusion, layouts, reduction plans, staging, the
hierarchical pipeline's arithmetic, transport agreement); they say nothing about CUDA itself.

``install`` wires the engine to the stand-ins, and ``submit_allreduce`` hands the engine a
grouped allreduce of host tensors as the torch frontend hands it CUDA tensors.  Used by
tests/parallel/test_gpu_executor.py (every rank, every result checked) and by
benchmarks/gpu_host_cost_bench.py (the host time those steps take).
"""
import collections
import ctypes
import itertools
import os
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from aiak_training.common.gpu import kernels, nccl

_NP = {nccl.INT8: np.int8, nccl.UINT8: np.uint8, nccl.INT32: np.int32, nccl.UINT32: np.uint32,
       nccl.INT64: np.int64, nccl.UINT64: np.uint64, nccl.FLOAT16: np.float16,
       nccl.FLOAT32: np.float32, nccl.FLOAT64: np.float64, nccl.BFLOAT16: np.uint16}


def _read(addr, count, dtype):
    """A copy of ``count`` elements at ``addr``, as float64 for bf16 (numpy has no bf16)."""
    raw = np.ctypeslib.as_array((ctypes.c_ubyte * (count * np.dtype(_NP[dtype]).itemsize))
                                .from_address(addr)).view(_NP[dtype]).copy() if count else \
        np.zeros(0, _NP[dtype])
    if dtype == nccl.BFLOAT16:
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw


def _write(addr, values, dtype):
    if not len(values):
        return
    if dtype == nccl.BFLOAT16:
        bits = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
        values = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    arr = np.ascontiguousarray(np.asarray(values).astype(_NP[dtype]))
    ctypes.memmove(addr, arr.ctypes.data, arr.nbytes)


class FakeRuntime:
    """``calls`` counts what would be CUDA runtime calls (by method name), so that tests can
    check how many a collective costs; ``held`` is each pooled event's uses not yet given
    back, so that tests can check that every holder returns what it took."""
    path = "fake libcudart (host memory)"

    def __init__(self):
        self._ids = itertools.count(1)
        self._blocks = {}
        self.copies = 0
        self.calls = collections.Counter()
        self.held = {}

    def _call(self, name):
        self.calls[name] += 1

    def device_count(self):
        return 1

    def set_device(self, device):
        self._call("set_device")

    def get_device(self):
        self._call("get_device")
        return 0

    def device_uuid(self, device):
        return f"fake-gpu-of-pid-{os.getpid()}"  # one "GPU" per process

    pci_bus_id = device_uuid

    def stream_create(self):
        self._call("stream_create")
        return next(self._ids)

    def stream_synchronize(self, stream):
        self._call("stream_synchronize")

    def event_get(self):
        return next(self._ids)

    def record(self, stream, uses=1):
        self._call("record")
        event = next(self._ids)
        self.held[event] = uses
        return event

    def event_put(self, event, uses=1):
        # Events from record() must come back exactly ``uses`` times; others (event_get)
        # once, untracked.
        if event in self.held:
            self.held[event] -= uses
            assert self.held[event] >= 0, f"event {event} given back more often than taken"
            if not self.held[event]:
                del self.held[event]

    def wait_event(self, stream, event):
        self._call("wait_event")

    def event_done(self, event):
        self._call("event_done")
        return True

    def event_synchronize(self, event):
        self._call("event_synchronize")

    def memcpy_async(self, dst, src, nbytes, stream):
        self._call("memcpy_async")
        self.copies += 1
        if nbytes:
            ctypes.memmove(dst, src, nbytes)

    def memset_async(self, dst, value, nbytes, stream):
        self._call("memset_async")
        if nbytes:
            ctypes.memset(dst, value, nbytes)

    def malloc(self, nbytes):
        self._call("malloc")
        block = np.empty(max(1, nbytes), np.uint8)
        self._blocks[block.ctypes.data] = block
        return block.ctypes.data

    def free(self, ptr):
        self._call("free")
        self._blocks.pop(ptr, None)

    host_alloc, free_host = malloc, free


class FakeLibrary:
    version = 23203
    path = "fake libnccl (MPI)"

    def __init__(self):
        self.group_depth = 0
        self.deferred = []
        self.groups = []  # per outermost group: how many calls it held

    def check(self, result, what):
        assert result == 0, what

    def unique_id(self):
        return bytes(128)

    def group_start(self):
        self.group_depth += 1

    def group_end(self):
        self.group_depth -= 1
        if self.group_depth == 0:
            ops, self.deferred = self.deferred, []
            self.groups.append(len(ops))
            _finish([pending for op in ops for pending in (op() or [])])


def _finish(pending):
    """Wait for (request, callback) pairs, posted before any wait as NCCL's group does."""
    for req, done in pending:
        result = req.wait()
        if done is not None:
            done(result)


class FakeCommunicator:
    """NCCL calls on an MPI communicator (element counts, in-place conventions, groups)."""

    def __init__(self, lib, mpi_comm):
        self.lib, self.comm = lib, mpi_comm.Dup()
        self.size, self.rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
        self.handle = 1
        self._custom = {}
        self._op_ids = itertools.count(100)
        self.calls = []

    @classmethod
    def create(cls, lib, mpi_comm):
        return cls(lib, mpi_comm)

    def async_error(self):
        return None

    def destroy(self):
        self.comm.Free()

    abort = destroy

    def pre_mul_sum(self, factor, nccl_dtype):
        encoded = nccl.scalar(factor, nccl_dtype)
        if encoded is None:
            return None
        op = next(self._op_ids)
        # Multiply by what NCCL would get: the factor as encoded in the tensor's type.
        self._custom[op] = factor if nccl_dtype in (nccl.FLOAT16, nccl.BFLOAT16) \
            else encoded.value
        return op

    def destroy_op(self, op):
        del self._custom[op]

    def _run(self, fn):
        """Run now, or at group_end inside a group; ``fn`` may return (request, callback)
        pairs still in flight."""
        if self.lib.group_depth:
            self.lib.deferred.append(fn)
        else:
            _finish(fn() or [])

    def _reduce(self, parts, op, dtype):
        parts = [p.astype(np.float64) if dtype in (nccl.FLOAT16, nccl.FLOAT32) else p
                 for p in parts]
        if op in self._custom:
            return sum(p * self._custom[op] for p in parts)
        if op in (nccl.SUM, nccl.AVG):
            total = parts[0].copy()
            for p in parts[1:]:
                total = total + p
            if op == nccl.AVG:
                if np.issubdtype(total.dtype, np.integer):
                    return np.trunc(total / self.size).astype(total.dtype)
                return total / self.size
            return total
        fn = {nccl.PROD: np.multiply, nccl.MAX: np.maximum, nccl.MIN: np.minimum}[op]
        out = parts[0]
        for p in parts[1:]:
            out = fn(out, p)
        return out

    def allreduce(self, send, recv, count, dtype, op, stream):
        self.calls.append(("allreduce", count))

        def run():
            parts = self.comm.allgather(_read(send, count, dtype))
            _write(recv, self._reduce(parts, op, dtype), dtype)
        self._run(run)

    def _check_overlap(self, full, full_count, block, block_count, dtype, what):
        """NCCL's in-place rule: overlapping buffers must be exactly block = full +
        rank * block_count elements."""
        item = np.dtype(_NP[dtype]).itemsize
        full_end, block_end = full + full_count * item, block + block_count * item
        if block < full_end and full < block_end:
            assert block == full + self.rank * block_count * item, \
                f"{what}: overlapping buffers that are not NCCL's in-place layout"

    def reduce_scatter(self, send, recv, recv_count, dtype, op, stream):
        self.calls.append(("reduce_scatter", recv_count))
        self._check_overlap(send, recv_count * self.size, recv, recv_count, dtype,
                            "ncclReduceScatter")

        def run():
            parts = self.comm.allgather(_read(send, recv_count * self.size, dtype))
            mine = self._reduce(parts, op, dtype)[self.rank * recv_count:
                                                 (self.rank + 1) * recv_count]
            _write(recv, mine, dtype)
        self._run(run)

    def allgather(self, send, recv, count, dtype, stream):
        self.calls.append(("allgather", count))
        self._check_overlap(recv, count * self.size, send, count, dtype, "ncclAllGather")

        def run():
            parts = self.comm.allgather(_read(send, count, dtype))
            _write(recv, np.concatenate(parts), dtype)
        self._run(run)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.calls.append(("broadcast", count))

        def run():
            data = self.comm.bcast(_read(send, count, dtype) if self.rank == root else None,
                                   root=root)
            _write(recv, data, dtype)
        self._run(run)

    def reduce(self, send, recv, count, dtype, op, root, stream):
        self.calls.append(("reduce", count))

        def run():
            parts = self.comm.gather(_read(send, count, dtype), root=root)
            if self.rank == root:
                _write(recv, self._reduce(parts, op, dtype), dtype)
        self._run(run)

    def send(self, buf, count, dtype, peer, stream):
        self.calls.append(("send", count))
        nbytes = count * np.dtype(_NP[dtype]).itemsize
        data = np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(buf)).copy()
        self._run(lambda: [(self.comm.Isend(data, dest=peer, tag=7), None)])

    def recv(self, buf, count, dtype, peer, stream):
        self.calls.append(("recv", count))
        landing = np.empty(count * np.dtype(_NP[dtype]).itemsize, np.uint8)
        self._run(lambda: [(self.comm.Irecv(landing, source=peer, tag=7),
                            lambda _: ctypes.memmove(buf, landing.ctypes.data, landing.nbytes))])


def install(runtime: FakeRuntime, library: FakeLibrary, kernel: Optional[bool],
            batched_copy: Callable) -> Callable[[], None]:
    """From now on the GPU executor sees ``runtime`` as libcudart and ``library`` (with
    :class:`FakeCommunicator`) as NCCL; ``kernel`` stands for the batched-copy kernel's
    library (None: as if it were not built) and ``batched_copy`` for its launch,
    ``(dsts, srcs, sizes, stream)``.  Returns a function that puts back what was there."""
    from aiak_training.runtime.execute import gpu_executor
    patches = [(gpu_executor, "runtime", lambda: runtime), (nccl, "library", lambda: library),
               (nccl, "Communicator", FakeCommunicator), (kernels, "library", lambda: kernel),
               (kernels, "batched_copy", batched_copy)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)

    def restore() -> None:
        for module, name, value in saved:
            setattr(module, name, value)
    return restore


def submit_allreduce(tensors: Sequence, outputs: Sequence, names: Sequence[str], reduce_op,
                     prescale: float = 1.0, postscale: float = 1.0,
                     ready_event: int = 0) -> Tuple[List, List[int]]:
    """A grouped allreduce of host tensors into ``outputs``, submitted as the torch frontend
    submits CUDA tensors on device 0 (one list per field to ``Engine.submit_allreduces``) and
    waited for with one ``wait_all``.  Returns (results, completion events)."""
    import aiak_training.torch as hvd
    from aiak_training.runtime import current
    from aiak_training.torch.submission import _DTYPES
    engine = current.engine()
    handles = engine.submit_allreduces(
        0, hvd.rank(), list(names), [int(_DTYPES[t.dtype]) for t in tensors],
        [tuple(t.shape) for t in tensors], [t.data_ptr() for t in tensors],
        [o.data_ptr() for o in outputs], reduce_op, prescale, postscale, (tensors, outputs),
        device=0, ready_event=ready_event)
    results, events = engine.wait_all(handles)
    assert all(events), "GPU ops complete with an event"
    return results, events
