"""Per-rank driver of tests/test_soak.py: a short soak that checks the runtime's tables.

    mpiexec -n 2 python tests/scripts/soak_check.py STEPS

Each step mixes the APIs of a training job (a DistributedOptimizer step, whose hooks start
in-place async allreduces; a grouped out-of-place allreduce, with results large enough for
the output pool; allreduce_async + synchronize; an allgather; a broadcast).  Between steps
everything this rank started is synchronized, so its tables must be back where they were: no
open handle, no pending entry, and from the second half on exactly the counts of the middle
step; right after init and after the final barrier, rank 0's coordinator table is empty too
(read while no rank can submit: see check_idle_everywhere).  Every few steps a process set
is added, used and removed.  Prints "soak check passed" per rank.
"""
import sys

import torch
import torch.nn.functional as F

import aiak_training.torch as hvd
from aiak_training.runtime import basics
from aiak_training.torch import output_pool, submission

# Counts of this rank's own operations: zero whenever it has synchronized everything.  (Rank
# 0's coordinator table also holds the requests of ranks that are already a step ahead, so it
# is zero only when every rank is idle, as after a barrier.)
IDLE_ZERO = ("open_handles", "entries", "queued_requests", "cached_pending", "uncached_pending",
             "submitted_pending")
PER_STEP_TENSORS = 7 + 62 + 20 + 2  # optimizer, grouped, async, allgather + broadcast


def counts() -> dict:
    c = dict(basics.runtime_counts())
    c["frontend_handle_map"] = len(submission._handle_map)
    c["pool_outstanding"] = output_pool.pool.outstanding
    c["pool_cached_blocks"] = output_pool.pool.cached_blocks
    return c


def check_idle(c: dict, where: str, everyone: bool = False) -> None:
    keys = IDLE_ZERO + ("frontend_handle_map", "pool_outstanding")
    for key in keys + (("coordinator_table",) if everyone else ()):
        assert c[key] == 0, f"{where}: {key} = {c[key]} ({c})"
    assert c["process_sets"] == 1 and c["foreign_process_sets"] == 0, (where, c)


def check_idle_everywhere(where: str) -> None:
    """check_idle on every rank, rank 0's coordinator table included.  That table holds the
    requests of ranks already ahead, so it is read while every rank is held here, outside
    the engine (an engine barrier would itself be such a request), until all have read."""
    from mpi4py import MPI  # after aiak_training, which sets MPI's thread level up
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE  # the engine's thread calls MPI too
    check_idle(counts(), where, everyone=True)
    MPI.COMM_WORLD.Barrier()


def main() -> None:
    steps = int(sys.argv[1])
    torch.set_num_threads(1)
    hvd.init(process_sets="dynamic")
    rank = hvd.rank()
    capacity = basics.engine().config.cache_capacity
    check_idle_everywhere("after init")

    # open_handles() counts a submitted, unsynchronized operation until it is waited for.
    h = hvd.allreduce_async(torch.ones(5), name="probe")
    assert basics.open_handles() == 1 and len(submission._handle_map) == 1
    hvd.synchronize(h)
    assert basics.open_handles() == 0 and len(submission._handle_map) == 0

    torch.manual_seed(0)
    # 3 x (weight, bias) small layers plus a 1 MiB embedding: mixed sizes, 7 tensors.
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(2048, 128),
                                 "l1": torch.nn.Linear(128, 64), "l2": torch.nn.Linear(64, 64),
                                 "l3": torch.nn.Linear(64, 8)})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    # 60 small tensors and two of 1-2 MiB (out-of-place results of >= 1 MiB use the pool).
    extra = [torch.randn(n) for n in [17, 64, 128, 1000] * 15] + \
        [torch.randn(300_000), torch.randn(500_000)]
    g = torch.Generator().manual_seed(rank)
    middle = None
    for step in range(steps):
        ids = torch.randint(2048, (4, 8), generator=g)
        x = model["emb"](ids).mean(1)
        out = model["l3"](torch.tanh(model["l2"](torch.tanh(model["l1"](x)))))
        opt.zero_grad(set_to_none=True)
        F.mse_loss(out, torch.zeros_like(out)).backward()
        opt.step()
        avg = hvd.grouped_allreduce(extra, name="extra")
        assert all(torch.equal(a, t) for a, t in zip(avg, extra))  # equal on both ranks
        del avg
        handles = [hvd.allreduce_async(t, name=f"async.{i}") for i, t in enumerate(extra[:20])]
        for h in handles:
            hvd.synchronize(h)
        gathered = hvd.allgather(torch.full((rank + 1, 2), float(step)), name="gather")
        assert gathered.shape == (3, 2)
        hvd.broadcast_(torch.zeros(3), root_rank=0, name="bcast")
        if step % 25 == 0:
            ps = hvd.add_process_set([0])
            if rank == 0:
                hvd.allreduce(torch.ones(2), name="in_set", process_set=ps)
            assert hvd.remove_process_set(ps)

        c = counts()
        check_idle(c, f"step {step}")
        assert c["coordinator_table"] <= PER_STEP_TENSORS, c
        c.pop("coordinator_table")
        assert c["cache_entries"] <= capacity, c
        assert c["pool_cached_blocks"] <= 2, c  # one block per pooled result size
        if step == steps // 2:
            middle = c
        elif middle is not None:
            assert c == middle, f"step {step}: {c} != step {steps // 2}: {middle}"
    hvd.barrier()
    check_idle_everywhere("at the end")
    hvd.shutdown()
    print(f"rank {rank}: soak check passed", flush=True)


if __name__ == "__main__":
    main()
