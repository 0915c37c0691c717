"""Train a model whose dense Adam state does not fit under a memory cap, by sharding that state
over the ranks (``shard_optimizer_state=True``).

Once the model is built, each rank caps its own memory with ``RLIMIT_DATA`` (what it already
uses, plus --bytes-per-param bytes per parameter, plus --slack-mib).  The kernel enforces the
cap: an allocation past it fails, as it would on a machine without that much memory.  Dense
data-parallel Adam needs 12 bytes per parameter above the weights (4 for the gradient, 8 for
the state) plus the runtime's buffers, more than the default 10 plus 96 MiB; sharded over N
ranks, a rank needs 16/N (the shard's working copy, gradient and state) plus a few buckets in
flight: 8 on 2 ranks (docs/sharded-optimizer.md, "Memory arithmetic").

    aiakrun -np 2 python examples/pytorch_sharded_memory_cap.py            # trains
    aiakrun -np 2 python examples/pytorch_sharded_memory_cap.py --dense    # hits the cap

The defaults (33.6M parameters, 6 steps) run on CPU in CI.  Bigger, e.g. 8 ranks and 201M
parameters (800 MB of weights, 1.6 GB of dense Adam state per rank):
    aiakrun -np 8 python examples/pytorch_sharded_memory_cap.py --width 4096 --layers 12
"""
import argparse
import ctypes
import ctypes.util
import os
import resource
import sys

# Freed collective results are kept for reuse by a pool (up to 1 GiB by default); under a
# memory cap that memory is better given back.  Read when aiak_training is imported.
os.environ.setdefault("AIAK_OUTPUT_POOL_BYTES", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import aiak_training.torch as hvd  # noqa: E402

MIB = 1 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=2048, help="width of the hidden layers")
    p.add_argument("--layers", type=int, default=8, help="number of width x width layers")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--bytes-per-param", type=float, default=10.0,
                   help="memory the cap leaves for training, in bytes per parameter, above "
                        "what a rank uses once the model is built")
    p.add_argument("--slack-mib", type=float, default=96.0,
                   help="extra room under the cap for the runtime: thread stacks, MPI's and "
                        "the engine's buffers, a bucket in flight")
    p.add_argument("--dense", action="store_true",
                   help="train with the dense DistributedOptimizer under the same cap (it "
                        "should fail with a message saying so)")
    return p.parse_args()


def data_bytes() -> int:
    """This process's data segment and private writable mappings (VmData), which
    RLIMIT_DATA limits."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status: this example needs Linux")


def return_freed_memory() -> None:
    """Have glibc's malloc map every block of 1 MiB or more on its own and unmap it when freed.
    By default it raises that threshold as blocks are freed (up to 32 MiB) and keeps freed
    blocks below it in its heap, still counted against the cap."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    m_mmap_threshold = -3  # <malloc.h>'s M_MMAP_THRESHOLD; setting it fixes the threshold
    if not libc.mallopt(m_mmap_threshold, MIB):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def cap_memory(extra: int) -> int:
    """Cap this process's data memory at what it uses now plus ``extra`` bytes; the cap."""
    cap = data_bytes() + extra
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY and hard < cap:
        raise SystemExit(f"RLIMIT_DATA's hard limit ({hard / MIB:.0f} MiB) is below the cap "
                         f"this example sets ({cap / MIB:.0f} MiB)")
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    return cap


def main() -> None:
    args = parse_args()
    return_freed_memory()
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # several ranks share this machine's cores

    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))
    params = sum(p.numel() for p in model.parameters())
    # Each rank fits its own batch, labelled by a fixed random linear teacher.
    g = torch.Generator().manual_seed(1000 + hvd.rank())
    teacher = torch.randn(args.width, 10, generator=torch.Generator().manual_seed(7))
    x = torch.randn(args.batch_size, args.width, generator=g)
    y = (x @ teacher).argmax(1)

    # From here on, everything training allocates counts against the cap: gradients,
    # optimizer state, the shards and the collectives' buffers.
    extra = int(args.bytes_per_param * params + args.slack_mib * MIB)
    cap = cap_memory(extra)
    mode = "dense" if args.dense else "sharded"
    if hvd.rank() == 0:
        n = hvd.size()
        print(f"{mode} Adam on {n} rank(s), {params / 1e6:.1f}M parameters; memory cap "
              f"{cap / MIB:.0f} MiB per rank, {extra / MIB:.0f} MiB above the built model, "
              f"where dense Adam needs 12 bytes a parameter ({12 * params / MIB:.0f} MiB) and "
              f"sharded Adam 16/N ({16 / n * params / MIB:.0f} MiB), plus the runtime's "
              "buffers and a few buckets in flight", flush=True)
    step = 0
    try:
        # Adam's usual scaling of the learning rate is left out: the point here is memory.
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                             named_parameters=model.named_parameters(),
                                             shard_optimizer_state=not args.dense)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            mean = hvd.allreduce(loss.detach(), name="loss")
            if hvd.rank() == 0:
                print(f"step {step:3d} loss {mean.item():.4f}", flush=True)
    except Exception as e:  # noqa: BLE001 - only allocation failures are handled below
        # Past the cap, torch's allocator raises "can't allocate memory", Python MemoryError,
        # and a thread (whose stack is data memory) fails to start, also in the engine.
        if not isinstance(e, MemoryError) and not any(
                s in str(e) for s in ("allocate memory", "can't start new thread")):
            raise
        print(f"rank {hvd.rank()}: {mode} training hit the memory cap of {cap / MIB:.0f} MiB "
              f"(RLIMIT_DATA) at step {step}: {str(e).splitlines()[0]}", file=sys.stderr,
              flush=True)
        # The other ranks may be waiting in a collective: leave at once, and let the
        # launcher end the job on this exit status.
        os._exit(3)
    if hvd.rank() == 0:
        print(f"done: {args.steps} steps under the cap", flush=True)


if __name__ == "__main__":
    main()
