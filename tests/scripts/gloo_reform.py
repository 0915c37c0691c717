"""Driver and worker for the Gloo re-forming test.

``python gloo_reform.py driver N`` starts a rendezvous store and N workers; each worker forms
a world of all N ranks, then repeatedly shuts down and re-forms smaller and larger worlds in
the same process (as an elastic job does), checking exact allreduce/allgather results and
that a process set works in every world.  Every worker prints one "worker R ok" line.
"""
import os
import subprocess
import sys

ROUNDS = [3, 2, 3, 1, 2]  # world sizes, in order (ranks >= size sit a round out)


def worker(rank: int, port: int) -> None:
    import torch
    import aiak_training.torch as hvd
    from aiak_training.runtime.transport import WorldInfo, set_world_source

    for round_no, size in enumerate(ROUNDS):
        if rank >= size:
            continue
        info = WorldInfo(rank=rank, size=size, local_rank=rank, local_size=size, cross_rank=0,
                         cross_size=1, hostname="localhost", addr="127.0.0.1", port=port,
                         prefix=f"round{round_no}")
        set_world_source(lambda info=info: info)
        hvd.init(process_sets="dynamic")
        assert (hvd.rank(), hvd.size()) == (rank, size), (hvd.rank(), hvd.size(), size)
        assert hvd.gloo_enabled() and not hvd.mpi_enabled()
        got = hvd.allreduce(torch.full((5,), float(rank + 1)), op=hvd.Sum, name="x")
        assert torch.equal(got, torch.full((5,), float(size * (size + 1) // 2))), got
        gathered = hvd.allgather(torch.full((rank + 1,), rank, dtype=torch.int64), name="g")
        expected = torch.cat([torch.full((r + 1,), r, dtype=torch.int64) for r in range(size)])
        assert torch.equal(gathered, expected), gathered
        if size > 2:  # a set of two ranks that is not the global set
            ps = hvd.add_process_set([0, size - 1])
            if rank in (0, size - 1):
                s = hvd.allreduce(torch.tensor([rank], dtype=torch.int32), op=hvd.Sum,
                                  process_set=ps, name="ps")
                assert s.item() == size - 1, s
            hvd.remove_process_set(ps)
        hvd.barrier()
        hvd.shutdown()
    set_world_source(None)
    print(f"worker {rank} ok", flush=True)


def driver(n: int) -> int:
    from aiak_training.runtime.transport import start_rendezvous_server
    store, port = start_rendezvous_server("127.0.0.1", 0)
    env = dict(os.environ, HOROVOD_LOG_LEVEL="INFO")
    env.pop("HOROVOD_CONTROLLER", None)  # the world source alone selects Gloo
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(r), str(port)], env=env)
             for r in range(n)]
    codes = [p.wait(timeout=240) for p in procs]
    del store
    return max(abs(c) for c in codes)


if __name__ == "__main__":
    if sys.argv[1] == "driver":
        sys.exit(driver(int(sys.argv[2])))
    worker(int(sys.argv[2]), int(sys.argv[3]))
