"""Allreduce algorithms (flat, hier_staged, hier_pipelined), checked exactly on every rank.

Launched by tests/test_hier_allreduce.py on several node layouts (virtual nodes through
HOROVOD_HOSTNAME, or a real emulated cluster).  Two groups of tests:

* ``test_algo_*`` call the algorithms directly, through the engine-independent interface
  ``algorithm(topology, addr, count, dtype, op)``, on numpy and torch buffers, with a tiny
  chunk so that every multi-chunk path (slot reuse, worker thread, uneven slices) runs.
  They use their own duplicate of COMM_WORLD, never the engine's communicators.
* ``test_engine_*`` go through ``hvd.allreduce`` with the algorithm the engine selected from
  the launch's environment (AIAK_ALLREDUCE_ALGO etc.); the driver says which one to expect in
  AIAK_TEST_EXPECT_ALGO.

Inputs are small integers, so every sum, product, min and max is exact in every dtype and the
references (computed here in int64 / float64 from every rank's input) must match bit for bit.
"""
import os
import socket

import numpy as np
import pytest
import torch
from mpi4py import MPI

import aiak_training.torch as hvd
from aiak_training.allreduce import ALGORITHMS, close_algorithm, create_algorithm
from aiak_training.runtime import current
from aiak_training.common.dtypes import DataType, ReduceOp
from aiak_training.common.topology import build_topology
from helpers import cast_like, expected_layout, scale_like_horovod

DTYPES = {torch.uint8: DataType.UINT8, torch.int8: DataType.INT8, torch.int16: DataType.INT16,
          torch.int32: DataType.INT32, torch.int64: DataType.INT64,
          torch.float16: DataType.FLOAT16, torch.bfloat16: DataType.BFLOAT16,
          torch.float32: DataType.FLOAT32, torch.float64: DataType.FLOAT64,
          torch.bool: DataType.BOOL}
OPS = {"sum": ReduceOp.SUM, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
       "product": ReduceOp.PRODUCT}
HVD_OPS = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product,
           "average": hvd.Average}
CHUNK_BYTES = 256  # 2..256 elements per chunk, depending on the dtype
ITEMSIZE = {dt: torch.empty(0, dtype=dt).element_size() for dt in DTYPES}


# ---- inputs and references (independent of the library) -------------------------------------
def rank_input(rank: int, n: int, dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    """Small integers: |sum| <= 3 * ranks, |product| <= 2 ** ranks, so all exact."""
    g = torch.Generator().manual_seed(7919 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if op == "product":
        choices = torch.tensor([1, 2] if dtype == torch.uint8 else [1, 2, -1])
        return choices[torch.randint(0, len(choices), (n,), generator=g)].to(dtype)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, (n,), generator=g).to(dtype)


def reference(n: int, dtype: torch.dtype, op: str, seed: int, size: int) -> torch.Tensor:
    inputs = [rank_input(r, n, dtype, op, seed) for r in range(size)]
    if dtype == torch.bool:
        stacked = torch.stack(inputs) if n else torch.zeros(size, 0, dtype=torch.bool)
        return stacked.any(0) if op in ("sum", "max") else stacked.all(0)
    wide = torch.stack([t.to(torch.float64) for t in inputs]) if n \
        else torch.zeros(size, 0, dtype=torch.float64)
    if op == "average":  # Horovod's: the (exact) sum, scaled as helpers.scale_like_horovod
        return scale_like_horovod(cast_like(wide.sum(0), dtype), 1.0 / size)
    out = {"sum": lambda: wide.sum(0),
           "min": lambda: wide.min(0).values if n else wide.sum(0),
           "max": lambda: wide.max(0).values if n else wide.sum(0),
           "product": lambda: wide.prod(0)}[op]()
    return cast_like(out, dtype)


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if not torch.equal(actual, expected):
        bad = (actual != expected).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{what}: {len(bad)}+ wrong elements, first at {bad}: "
                             f"got {actual[bad].tolist()} want {expected[bad].tolist()}")


# ---- direct algorithm calls --------------------------------------------------------------------
@pytest.fixture(scope="module")
def topo():
    t = build_topology(MPI.COMM_WORLD.Dup())
    yield t
    t.free()


@pytest.fixture(scope="module")
def algos(topo):
    made = {name: create_algorithm(name, topo, **({"chunk_bytes": CHUNK_BYTES}
                                                  if name == "hier_pipelined" else {}))
            for name in ALGORITHMS}
    yield made
    for a in made.values():
        close_algorithm(a)


def run_algo(algo, topo, n: int, dtype: torch.dtype, op: str, seed: int,
             use_numpy: bool = False) -> None:
    t = rank_input(topo.rank, n, dtype, op, seed)
    if use_numpy and dtype not in (torch.bfloat16,):  # numpy has no bfloat16
        arr = t.numpy().copy()
        algo(topo, arr.ctypes.data, n, DTYPES[dtype], OPS[op])
        result = torch.from_numpy(arr)
    else:
        algo(topo, t.data_ptr(), n, DTYPES[dtype], OPS[op])
        result = t
    assert_exact(result, reference(n, dtype, op, seed, topo.size),
                 f"{getattr(algo, 'name', 'flat')} n={n} {dtype} {op}")


def test_algo_layout_matches_launch(topo):
    layout = expected_layout()
    if layout is not None:
        assert topo.node_sizes == layout
    assert topo.size == MPI.COMM_WORLD.Get_size()


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: str(d).replace("torch.", ""))
def test_algo_every_dtype_and_op(algos, topo, name, dtype):
    per_chunk = CHUNK_BYTES // ITEMSIZE[dtype]
    # One element; an odd prime that fits one chunk (inline path); several chunks with a
    # ragged last one (worker path, uneven slices, slot reuse).
    sizes = [1, 13, 4 * per_chunk + 7]
    for op in OPS:
        for i, n in enumerate(sizes):
            run_algo(algos[name], topo, n, dtype, op, seed=100 + i, use_numpy=i % 2 == 1)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_algo_sizes(algos, topo, name):
    L = topo.local_size
    sizes = sorted({0, 1, 2, 3, max(L - 1, 0), L, L + 1, 2 * L - 1, 5, 7, 11, 31, 61, 64, 127,
                    1021, 9973})
    for n in sizes:
        run_algo(algos[name], topo, n, torch.float32, "sum", seed=n)
        run_algo(algos[name], topo, n, torch.int64, "max", seed=n, use_numpy=True)


def test_algo_interleaved_calls_reuse_state(algos, topo):
    """Back-to-back calls of every algorithm with changing sizes and dtypes: hier_pipelined's
    chunk counters and slots carry over between calls."""
    rng = np.random.default_rng(2024)  # same sequence on every rank
    kinds = [(torch.float32, "sum"), (torch.float16, "max"), (torch.int8, "min"),
             (torch.float64, "product"), (torch.bool, "sum")]
    for step in range(30):
        name = ALGORITHMS[step % len(ALGORITHMS)]
        dtype, op = kinds[int(rng.integers(len(kinds)))]
        n = int(rng.integers(0, 3000))
        run_algo(algos[name], topo, n, dtype, op, seed=step)


@pytest.mark.parametrize("options, sizes", [
    ({"chunk_bytes": 64, "slots": 3}, [3, 97, 1999]),        # smallest chunk, fewest slots
    ({"chunk_bytes": 1000}, [3, 97, 5003]),                  # rounded up to cache lines
    ({"chunk_bytes": 4096, "use_worker": False}, [97, 5003]),  # all steps on this thread
    ({"chunk_bytes": 1 << 20}, [5003, 40009]),               # one chunk for everything
])
def test_algo_hier_pipelined_tuning_options(topo, options, sizes):
    algo = create_algorithm("hier_pipelined", topo, **options)
    try:
        if getattr(algo, "name", "") == "hier_pipelined":
            assert algo.chunk_bytes % 64 == 0 and algo.chunk_bytes >= options["chunk_bytes"]
        for i, n in enumerate(sizes):
            run_algo(algo, topo, n, torch.float32, "sum", seed=i)
            run_algo(algo, topo, n, torch.int16, "min", seed=i)
    finally:
        close_algorithm(algo)


def test_algo_hier_pipelined_small_messages_use_flat(topo):
    algo = create_algorithm("hier_pipelined", topo, chunk_bytes=256, min_bytes=1024)
    try:
        for n in (1, 100, 255, 256, 1000):  # float32: below and above 1 KiB
            run_algo(algo, topo, n, torch.float32, "sum", seed=n)
    finally:
        close_algorithm(algo)


def test_algo_hier_pipelined_without_shared_memory_falls_back(topo):
    # 64 TiB slots cannot be mapped anywhere: every rank must agree to use hier_staged.
    algo = create_algorithm("hier_pipelined", topo, chunk_bytes=1 << 46)
    try:
        assert getattr(algo, "name", "") == "hier_staged"
        run_algo(algo, topo, 1001, torch.float32, "sum", seed=9)
    finally:
        close_algorithm(algo)


def test_algo_rejects_unsupported_op_then_still_works(algos, topo):
    x = torch.ones(10, dtype=torch.bool)
    for name in ALGORITHMS:
        with pytest.raises(ValueError):
            algos[name](topo, x.data_ptr(), 10, DataType.BOOL, ReduceOp.AVERAGE)
        run_algo(algos[name], topo, 1000, torch.float32, "sum", seed=5)


# ---- through the engine ------------------------------------------------------------------------
def engine_algorithm_name() -> str:
    algo = current.engine().sets.get(0).algorithm
    return getattr(algo, "name", "flat")


def test_engine_selected_algorithm():
    expected = os.environ.get("AIAK_TEST_EXPECT_ALGO")
    if expected is None:
        pytest.skip("the launcher did not say which algorithm to expect")
    assert engine_algorithm_name() == expected


def test_engine_topology_on_real_nodes():
    if os.environ.get("AIAK_TEST_REAL_NODES") != "1":
        pytest.skip("virtual nodes (HOROVOD_HOSTNAME) in this launch")
    # On an emulated cluster each node is its own namespace with its own hostname, and the
    # node grouping comes from MPI's shared-memory split, not from HOROVOD_HOSTNAME.
    assert "HOROVOD_HOSTNAME" not in os.environ
    names = MPI.COMM_WORLD.allgather(socket.gethostname())
    layout = expected_layout() or [hvd.size()]
    assert len(set(names)) == len(layout)
    assert hvd.local_size() == layout[0] and hvd.cross_size() == len(layout)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: str(d).replace("torch.", ""))
def test_engine_allreduce_every_dtype_and_op(dtype):
    chunk = int(os.environ.get("AIAK_HIER_CHUNK_BYTES", "4096"))
    sizes = [1, 3 * chunk // ITEMSIZE[dtype] + 5]  # single and multi-chunk
    ops = ["sum", "min", "max", "product"] + ([] if dtype == torch.bool else ["average"])
    for op in ops:
        for i, n in enumerate(sizes):
            src_op = "sum" if op == "average" else op
            mine = rank_input(hvd.rank(), n, dtype, src_op, seed=300 + i)
            out = hvd.allreduce(mine, op=HVD_OPS[op], name=f"eng.{dtype}.{op}.{n}")
            assert_exact(out, reference(n, dtype, op, 300 + i, hvd.size()),
                         f"engine {engine_algorithm_name()} {dtype} {op} n={n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_engine_prescale_postscale(dtype):
    n = 2 * int(os.environ.get("AIAK_HIER_CHUNK_BYTES", "4096")) // ITEMSIZE[dtype] + 3
    inputs = [rank_input(r, n, dtype, "sum", seed=400) for r in range(hvd.size())]
    for pre, post in [(2.0, 1.0), (1.0, 0.5), (2.0, 0.25)]:
        out = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, prescale_factor=pre,
                            postscale_factor=post, name=f"scaled.{dtype}.{pre}.{post}")
        scaled = torch.stack([cast_like(t.to(torch.float64) * pre, dtype).to(torch.float64)
                              for t in inputs]).sum(0)
        assert_exact(out, cast_like(scaled * post, dtype), f"pre={pre} post={post}")


def test_engine_fused_group_and_inplace():
    # Small tensors go through the fusion buffer (one algorithm call for all of them); the
    # big one is reduced in place.
    chunk = int(os.environ.get("AIAK_HIER_CHUNK_BYTES", "4096"))
    sizes = [1, 7, 300, 2 * chunk + 1, 5, 1 << 18]
    inputs = [rank_input(hvd.rank(), n, torch.float32, "sum", seed=500 + i)
              for i, n in enumerate(sizes)]
    outs = hvd.grouped_allreduce(inputs, op=hvd.Sum, name="fused")
    for i, (n, out) in enumerate(zip(sizes, outs)):
        assert_exact(out, reference(n, torch.float32, "sum", 500 + i, hvd.size()), f"n={n}")
    t = rank_input(hvd.rank(), 99991, torch.float64, "sum", seed=600)
    hvd.allreduce_(t, op=hvd.Average, name="inplace")
    assert_exact(t, reference(99991, torch.float64, "average", 600, hvd.size()), "in place")
