"""The Gloo communicator: mpi4py's calls, as the engine makes them, run on one
``torch.distributed.ProcessGroupGloo``.

A :class:`GlooComm` belongs to a world that ``gloo.py`` formed (the rendezvous store and
every process group made over it, closed together at ``hvd.shutdown()``); new
communicators (``Split``, ``Create``, ...) get their process groups from that world.  Buffer
specs and reduce ops arrive as mpi4py's (``[buffer, count, datatype]``, ``MPI.SUM``) and are
decoded here into byte views and Gloo's reductions.
"""
import functools
import itertools
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from aiak_training.common.dtypes import ITEMSIZE, DataType, ReduceOp


# ---- datatypes and reduce ops ------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _datatypes() -> Dict[int, DataType]:
    """id(mpi4py datatype) -> our DataType (half types travel as UINT16: the op says which)."""
    from aiak_training.common.dtypes import mpi_datatype
    table: Dict[int, DataType] = {}
    for dtype in DataType:
        table.setdefault(id(mpi_datatype(dtype)), dtype)
    return table


@functools.lru_cache(maxsize=None)
def _builtin_ops() -> Dict[int, str]:
    from mpi4py import MPI
    return {id(MPI.SUM): "sum", id(MPI.MIN): "min", id(MPI.MAX): "max", id(MPI.PROD): "prod",
            id(MPI.LOR): "lor", id(MPI.LAND): "land", id(MPI.BAND): "band"}


_OP_WORDS = {ReduceOp.SUM: "sum", ReduceOp.AVERAGE: "sum", ReduceOp.MIN: "min",
             ReduceOp.MAX: "max", ReduceOp.PRODUCT: "prod"}


def _decode_op(op: Any) -> Tuple[str, Optional[DataType]]:
    """(reduction word, element type it implies or None) of an op from ``dtypes.mpi_op``."""
    word = _builtin_ops().get(id(op))
    if word is not None:
        return word, None
    from aiak_training.common.dtypes import user_op_key
    key = user_op_key(op)
    if key is None:
        raise ValueError(f"Gloo transport: unsupported reduce op {op!r}.")
    return _OP_WORDS[key[1]], key[0]


@functools.lru_cache(maxsize=None)
def _torch_types() -> Dict[DataType, Any]:
    import torch
    return {DataType.UINT8: torch.uint8, DataType.INT8: torch.int8, DataType.INT32: torch.int32,
            DataType.INT64: torch.int64, DataType.FLOAT16: torch.float16,
            DataType.BFLOAT16: torch.bfloat16, DataType.FLOAT32: torch.float32,
            DataType.FLOAT64: torch.float64, DataType.BOOL: torch.uint8,
            DataType.INT16: torch.int16, DataType.UINT16: torch.int16}


def _spec(buf: Any) -> Tuple[Any, int, Optional[Tuple[List[int], List[int]]], DataType]:
    """(memory, byte length, (counts, displs) or None, element type) of an mpi4py buffer
    spec: a numpy array, or ``[buffer, count | (counts, displs), datatype]``."""
    if isinstance(buf, np.ndarray):
        if buf.dtype == np.uint64:  # negotiation's bit vector: only ever reduced with BAND
            return buf, buf.nbytes, None, DataType.INT64
        dtype = {np.dtype(np.int64): DataType.INT64, np.dtype(np.int32): DataType.INT32,
                 np.dtype(np.uint8): DataType.UINT8, np.dtype(np.float32): DataType.FLOAT32,
                 np.dtype(np.float64): DataType.FLOAT64}.get(buf.dtype)
        if dtype is None:
            raise ValueError(f"Gloo transport: numpy buffers of {buf.dtype} are not supported.")
        return buf, buf.nbytes, None, dtype
    memory, count, datatype = buf
    dtype = _datatypes().get(id(datatype))
    if dtype is None:
        raise ValueError(f"Gloo transport: unsupported datatype {datatype!r}.")
    if isinstance(count, (tuple, list)):
        counts, displs = [int(c) for c in count[0]], [int(d) for d in count[1]]
        return memory, len(memory), (counts, displs), dtype
    return memory, int(count) * ITEMSIZE[dtype], None, dtype


def byte_view(memory: Any, nbytes: int):
    """A uint8 tensor over the first ``nbytes`` of ``memory`` (shared, not copied)."""
    import torch
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if isinstance(memory, np.ndarray):
        return torch.from_numpy(memory.reshape(-1).view(np.uint8))[:nbytes]
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)


class _Group:
    """``GlooComm.Get_group()``: the ranks a ``Create`` call keeps."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = list(ranks)

    def Incl(self, ranks: Sequence[int]) -> "_Group":
        return _Group([self.ranks[r] for r in ranks])

    def Free(self) -> None:
        pass


# ---- the communicator ---------------------------------------------------------------------------
class GlooComm:
    """One communicator of a Gloo world, with the mpi4py calls of
    :class:`aiak_training.runtime.transport.Comm`.

    A communicator of one rank has no process group: its collectives are local copies.
    ``Dup`` shares the process group (only the engine thread uses a world's groups, one call at
    a time, which is all a Gloo group needs); ``Split``/``Split_type``/``Create`` make new
    groups over the same store, named after the parent and a per-communicator counter that
    advances identically on every member.
    """
    transport = "gloo"

    def __init__(self, world: Any, group: Any, rank: int, size: int, key: str,
                 hostname: str):
        """``world``: the formed world (``gloo.py``) whose store makes new process groups
        (``new_group``) and which holds its communicators (``comms``) until it closes."""
        self.world = world
        self._group = group
        self._rank = rank
        self._size = size
        self._key = key
        self._hostname = hostname
        self._children = itertools.count()
        world.comms.append(self)

    # ---- local --------------------------------------------------------------------------
    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    def Set_errhandler(self, errhandler: Any) -> None:
        """Gloo errors are always raised as exceptions (what ERRORS_RETURN asks of MPI)."""

    def Free(self) -> None:
        self._group = None

    def __repr__(self) -> str:
        return f"GlooComm({self._key}, rank {self._rank} of {self._size})"

    def _pg(self):
        if self._group is None:
            if self.world.closed:
                raise RuntimeError("Gloo transport: this world was shut down.")
            raise RuntimeError(f"Gloo transport: communicator {self._key} was freed.")
        return self._group

    # ---- new communicators ------------------------------------------------------------------
    def _child(self, members: List[int], label: str) -> "GlooComm":
        key = f"{self._key}.{label}"
        rank = members.index(self._rank)
        if len(members) == self._size:
            group = self._group  # same members, same order: share the connections
        elif len(members) > 1:
            group = self.world.new_group(key, rank, len(members))
        else:
            group = None
        return GlooComm(self.world, group, rank, len(members), key, self._hostname)

    def Dup(self) -> "GlooComm":
        return GlooComm(self.world, self._group, self._rank, self._size,
                        f"{self._key}.d{next(self._children)}", self._hostname)

    def Split(self, color: int = 0, key: int = 0) -> Any:
        n = next(self._children)
        pairs = self.allgather((color, key))
        if color is None or color < 0:
            from mpi4py import MPI
            return MPI.COMM_NULL
        members = sorted((r for r, (c, _) in enumerate(pairs) if c == color),
                         key=lambda r: (pairs[r][1], r))
        return self._child(members, f"s{n}c{color}")

    def Split_type(self, split_type: int, key: int = 0) -> Any:
        """Node-local communicators: Gloo knows hosts by the world's hostnames."""
        n = next(self._children)
        names = self.allgather((self._hostname, key))
        order = list(dict.fromkeys(h for h, _ in names))
        members = sorted((r for r, (h, _) in enumerate(names) if h == self._hostname),
                         key=lambda r: (names[r][1], r))
        return self._child(members, f"t{n}h{order.index(self._hostname)}")

    def Get_group(self) -> _Group:
        return _Group(range(self._size))

    def Create(self, group: _Group) -> Any:
        """Members get the new communicator, the others ``MPI.COMM_NULL`` (as mpi4py)."""
        n = next(self._children)  # advances on every rank: the next name agrees everywhere
        if self._rank not in group.ranks:
            from mpi4py import MPI
            return MPI.COMM_NULL
        return self._child(sorted(group.ranks), f"c{n}")

    # ---- pickled objects ----------------------------------------------------------------------
    def allgather(self, obj: Any) -> List[Any]:
        if self._size == 1:
            return [obj]
        import torch
        pg = self._pg()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        mine = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self._size)]
        pg.allgather([lengths], [mine]).wait()
        sizes = [int(t.item()) for t in lengths]
        width = max(sizes)
        send = torch.zeros(width, dtype=torch.uint8)
        send[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        recv = [torch.empty(width, dtype=torch.uint8) for _ in range(self._size)]
        pg.allgather([recv], [send]).wait()
        return [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(recv, sizes)]

    def gather(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        gathered = self.allgather(obj)
        return gathered if self._rank == root else None

    def bcast(self, obj: Any, root: int = 0) -> Any:
        if self._size == 1:
            return obj
        import torch
        import torch.distributed as dist
        pg = self._pg()
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self._rank == root else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        pg.broadcast([length], opts).wait()
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        if self._rank == root:
            payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        pg.broadcast([payload], opts).wait()
        return obj if self._rank == root else pickle.loads(payload.numpy().tobytes())

    def barrier(self) -> None:
        if self._size > 1:
            self._pg().barrier().wait()

    # ---- raw memory -----------------------------------------------------------------------------
    def allreduce_tensor(self, data, dtype: DataType, word: str) -> None:
        """Reduce ``data`` (a uint8 view of the elements) in place across the communicator."""
        import torch
        import torch.distributed as dist
        elems = data.view(_torch_types()[dtype])
        wide = None
        if dtype in (DataType.INT16, DataType.UINT16):
            # Gloo has no 16-bit integer kernels: reduce as int64 and narrow back, which keeps
            # MPI's wrap-around results (sums and products modulo 2**16).
            wide = elems.to(torch.int64)
            if dtype == DataType.UINT16:
                wide &= 0xFFFF
        elif dtype == DataType.BOOL and word in ("lor", "land"):
            word = "max" if word == "lor" else "min"  # 0/1 bytes: or = max, and = min
        op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
              "prod": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND}.get(word)
        if op is None:
            raise ValueError(f"Gloo transport: cannot reduce {dtype.name} with {word}.")
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        target = elems if wide is None else wide
        self._pg().allreduce([target], opts).wait()
        if wide is not None:
            elems.copy_(wide.to(elems.dtype))

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:
        from mpi4py import MPI
        word, implied = _decode_op(MPI.SUM if op is None else op)
        memory, nbytes, _, dtype = _spec(recvbuf)
        if implied is not None:
            dtype = implied
        data = byte_view(memory, nbytes)
        if sendbuf is not MPI.IN_PLACE:
            src, src_bytes, _, _ = _spec(sendbuf)
            data.copy_(byte_view(src, src_bytes))
        if self._size > 1 and nbytes:
            self.allreduce_tensor(data, dtype, word)

    def broadcast_tensor(self, data, root: int) -> None:
        """Broadcast ``data`` (a uint8 tensor) in place from ``root``."""
        import torch.distributed as dist
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._pg().broadcast([data], opts).wait()

    def _gather_tensor(self, data, outputs: Optional[List[Any]], root: int) -> None:
        """Gather equal-sized ``data`` into ``outputs`` (one tensor per rank) on ``root``;
        ``outputs`` is None on the other ranks."""
        import torch.distributed as dist
        opts = dist.GatherOptions()
        opts.rootRank = root
        self._pg().gather([outputs] if outputs is not None else [], [data], opts).wait()

    def Bcast(self, buf: Any, root: int = 0) -> None:
        if self._size == 1:
            return
        memory, nbytes, _, _ = _spec(buf)
        if nbytes:
            self.broadcast_tensor(byte_view(memory, nbytes), root)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Equal pieces: Gloo gathers them straight into the receive buffer (no padding,
        no per-rank temporaries as in :meth:`Allgatherv`)."""
        send_mem, send_bytes, _, _ = _spec(sendbuf)
        recv_mem = _spec(recvbuf)[0]  # its count is per rank, as in MPI
        recv_bytes = send_bytes * self._size
        out, mine = byte_view(recv_mem, recv_bytes), byte_view(send_mem, send_bytes)
        if self._size == 1:
            out.copy_(mine)
        elif recv_bytes:
            self._pg()._allgather_base(out, mine).wait()

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        import torch
        send_mem, send_bytes, _, _ = _spec(sendbuf)
        recv_mem, recv_len, layout, dtype = _spec(recvbuf)
        item = ITEMSIZE[dtype]
        counts, displs = layout
        out = byte_view(recv_mem, recv_len)
        mine = byte_view(send_mem, send_bytes)
        if self._size == 1:
            out[displs[0] * item:displs[0] * item + send_bytes].copy_(mine)
            return
        # Gloo gathers equal pieces: pad every piece to the largest, then place them.
        width = max(counts) * item
        send = torch.zeros(width, dtype=torch.uint8)
        send[:send_bytes].copy_(mine)
        recv = [torch.empty(width, dtype=torch.uint8) for _ in range(self._size)]
        self._pg().allgather([recv], [send]).wait()
        for r, piece in enumerate(recv):
            start = displs[r] * item
            out[start:start + counts[r] * item].copy_(piece[:counts[r] * item])

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        import torch
        import torch.distributed as dist
        send_mem, send_len, (scounts, sdispls), dtype = _spec(sendbuf)
        recv_mem, recv_len, (rcounts, rdispls), _ = _spec(recvbuf)
        item = ITEMSIZE[dtype]
        src, dst = byte_view(send_mem, send_len), byte_view(recv_mem, recv_len)

        def packed(counts, displs, mem):
            # alltoall_base wants pieces back to back, in rank order
            total = sum(counts) * item
            if all(displs[r] == sum(counts[:r]) for r in range(len(counts))):
                return mem[:total], False
            return torch.empty(total, dtype=torch.uint8), True

        send, send_copied = packed(scounts, sdispls, src)
        if send_copied:
            off = 0
            for c, d in zip(scounts, sdispls):
                send[off:off + c * item].copy_(src[d * item:(d + c) * item])
                off += c * item
        recv, recv_copied = packed(rcounts, rdispls, dst)
        if self._size == 1:
            recv.copy_(send)
        else:
            self._pg().alltoall_base(recv, send, [c * item for c in rcounts],
                                     [c * item for c in scounts],
                                     dist.AllToAllOptions()).wait()
        if recv_copied:
            off = 0
            for c, d in zip(rcounts, rdispls):
                dst[d * item:(d + c) * item].copy_(recv[off:off + c * item])
                off += c * item

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any,
                       recvcounts: Optional[Sequence[int]] = None, op: Any = None) -> None:
        """Reduce everything, keep this rank's block: Gloo's own reduce-scatter wants equal
        blocks, the engine's may differ by one row, and this path is not a hot one."""
        from mpi4py import MPI
        word, implied = _decode_op(MPI.SUM if op is None else op)
        send_mem, send_bytes, _, dtype = _spec(sendbuf)
        recv_mem, recv_bytes, _, _ = _spec(recvbuf)
        if implied is not None:
            dtype = implied
        item = ITEMSIZE[dtype]
        counts = list(recvcounts) if recvcounts is not None else \
            [recv_bytes // item] * self._size
        whole = byte_view(send_mem, send_bytes).clone()
        if self._size > 1 and send_bytes:
            self.allreduce_tensor(whole, dtype, word)
        start = sum(counts[:self._rank]) * item
        byte_view(recv_mem, recv_bytes).copy_(whole[start:start + counts[self._rank] * item])
