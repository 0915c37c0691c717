"""aiak-training against PyTorch DDP: the same training step in the same processes (issue 39).

Every rank runs two copies of the e2e MLP of benchmarks/ (3072-1024-1024-1024-10, 5.26M
parameters; SGD, momentum 0.9; batch 64 per rank; one intra-op thread): one wrapped in
``torch.nn.parallel.DistributedDataParallel`` over torch.distributed's Gloo (DDP's defaults:
25 MB buckets, the first one 1 MB; plus each ``--ddp-bucket-mb`` value), one trained with
``hvd.DistributedOptimizer`` at aiak-training's defaults.  Blocks of ``--block`` steps of
each variant alternate (A B C A B C ...), after a warm-up round; the step time is a block's
mean, and the median over ``--reps`` blocks is reported.  The CPU each process used during a
variant's blocks (``time.process_time()``, all threads: Gloo's, MPI's progress, the
engine's) is reported per step, and apart from it that of the engine's thread alone (named
``aiak-engine``; MPI's waits made on it count there).  DDP's ranks meet through a
``FileStore`` on the shared file system and send over the emulated cluster's interface
(``GLOO_SOCKET_IFNAME``).

Run with MPI (``hvd.init()`` gives the ranks), on the emulated cluster as root::

    python -m aiak_training.testing.cluster --nodes 4 --ranks-per-node 1 --rate 1gbit -- \\
        sh -c 'mpiexec -n 4 python benchmarks/ddp_bench.py --json out.json'

Ratios (above 1 means aiak-training is better):

  aiak_vs_ddp_step_<layout>_<rate>    the fastest DDP variant's median step / aiak's.
  aiak_vs_ddp_default_step_<layout>_<rate>   DDP at its defaults / aiak.
  cpu_ddp_over_aiak_<layout>_<rate>   the CPU per step of that fastest DDP variant / aiak's,
                                      averaged over the ranks (target >= 1/1.2).  DDP's
                                      includes the idle engine of hvd.init() in its process.
  flat_allreduce_vs_gloo_<layout>_<rate>    with --allreduce-mib: Gloo's all_reduce / ours.
  flat_allreduce_vs_bound_<layout>_<rate>   the byte bound 2(n-1)/n x bytes at the link rate
                                      / ours (1.0 is the bound).
  aiak_overlap_vs_ddp_step_<layout>_<rate>   with --overlap: the fastest DDP variant / aiak
                                      with overlap_update=True (the update of each gradient
                                      runs as it lands, while the rest are on the wire).

With ``--phases`` it also times the phases of one step of each (forward, backward, waiting
for gradients, the update) in extra blocks after the A/B ones, and reports their medians.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import link_gbit, machine_info, report, summarize  # noqa: E402

import aiak_training.torch as hvd  # noqa: E402

BATCH = 64


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3072, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10))


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def join_gloo() -> None:
    """DDP's process group: every rank opens the FileStore rank 0 named (a fresh file on the
    file system all emulated nodes share), bound to the cluster's interface if there is one."""
    iface = os.environ.get("AIAK_CLUSTER_IFACE")
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    path = None
    if hvd.rank() == 0:
        fd, path = tempfile.mkstemp(prefix="ddp_bench_store.")
        os.close(fd)
        os.unlink(path)
    path = hvd.broadcast_object(path, root_rank=0, name="ddp_bench_store")
    store = dist.FileStore(path, hvd.size())
    dist.init_process_group("gloo", store=store, rank=hvd.rank(), world_size=hvd.size())


class Variant:
    """One way of training the model: a step, and the phases of a step when timed apart."""

    def __init__(self, name: str, step: Callable[[], None],
                 phased: Callable[[Dict[str, List[float]]], None]):
        self.name, self.step, self.phased = name, step, phased
        self.block_s: List[float] = []
        self.cpu_s: List[float] = []
        self.engine_cpu_s: List[float] = []
        self.phases: Dict[str, List[float]] = {}


def training_step(model, opt, data, target, loss_fn) -> Callable[[], None]:
    """One plain step: zero the gradients, forward, backward, optimizer step."""
    def step() -> None:
        opt.zero_grad()
        loss_fn(model(data), target).backward()
        opt.step()
    return step


def phased_step(model, opt, data, target, loss_fn, finish: Callable[[Dict], None],
                backward_key: str = "backward") -> Callable[[Dict[str, List[float]]], None]:
    """A step timed by phase: forward, backward (under ``backward_key``), then ``finish`` (the
    wait for gradients and the update, which records its own phases in ``out``)."""
    def phased(out: Dict[str, List[float]]) -> None:
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = loss_fn(model(data), target)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        out.setdefault("forward", []).append(t1 - t0)
        out.setdefault(backward_key, []).append(t2 - t1)
        finish(out)
    return phased


def ddp_variant(name: str, bucket_mb: float, data, target, loss_fn) -> Variant:
    model = torch.nn.parallel.DistributedDataParallel(build_model(), bucket_cap_mb=bucket_mb)
    opt = sgd(model)

    def finish(out: Dict[str, List[float]]) -> None:
        t0 = time.perf_counter()
        opt.step()
        out.setdefault("update", []).append(time.perf_counter() - t0)
    # DDP's backward returns once every bucket is reduced: its wait is inside it.
    return Variant(name, training_step(model, opt, data, target, loss_fn),
                   phased_step(model, opt, data, target, loss_fn, finish, "backward_and_wait"))


def aiak_variant(data, target, loss_fn, overlap: bool = False) -> Variant:
    model = build_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   overlap_update=overlap)

    def finish(out: Dict[str, List[float]]) -> None:
        t0 = time.perf_counter()
        if overlap:  # the update runs as each gradient lands: step() waits and updates
            t1 = t0
            opt.step()
        else:
            opt.synchronize()
            t1 = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
        t2 = time.perf_counter()
        out.setdefault("wait", []).append(t1 - t0)
        out.setdefault("update", []).append(t2 - t1)
    return Variant("aiak_overlap" if overlap else "aiak",
                   training_step(model, opt, data, target, loss_fn),
                   phased_step(model, opt, data, target, loss_fn, finish))


def allreduce_variants(mib: float) -> List[Variant]:
    """One allreduce of `mib` MiB of float32: the engine's (hvd.allreduce_, flat on one rank
    per node) against torch.distributed's Gloo ring in the same processes."""
    ours, gloo = torch.ones(int(mib * (1 << 20)) // 4), torch.ones(int(mib * (1 << 20)) // 4)
    return [Variant("allreduce_aiak", lambda: hvd.allreduce_(ours, op=hvd.Sum, name="raw"),
                    lambda out: None),
            Variant("allreduce_gloo", lambda: dist.all_reduce(gloo), lambda out: None)]


def engine_cpu_s() -> float:
    """CPU time of the engine's C++ thread (named aiak-engine) so far: its own work and
    the MPI library's progress while it waits."""
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "aiak-engine":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


def run_block(v: Variant, steps: int, timed: bool) -> None:
    hvd.barrier()
    v.step()  # one untimed step after the other variant's block
    hvd.barrier()
    cpu, engine, start = time.process_time(), engine_cpu_s(), time.perf_counter()
    for _ in range(steps):
        v.step()
    hvd.barrier()
    if timed:
        v.block_s.append((time.perf_counter() - start) / steps)
        v.cpu_s.append((time.process_time() - cpu) / steps)
        v.engine_cpu_s.append((engine_cpu_s() - engine) / steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--block", type=int, default=10, help="steps per timed block")
    p.add_argument("--ddp-bucket-mb", type=float, nargs="*", default=[],
                   help="DDP bucket sizes to try besides its default 25 MB")
    p.add_argument("--phases", action="store_true")
    p.add_argument("--overlap", action="store_true",
                   help="also time aiak with overlap_update=True (aiak_overlap_vs_ddp_step_*)")
    p.add_argument("--link-gbit", type=float, default=None)
    p.add_argument("--allreduce-mib", type=float, default=0,
                   help="also time one allreduce of this many MiB, aiak against Gloo's ring "
                        "(flat_allreduce_vs_gloo_*, flat_allreduce_vs_bound_*)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.reps < 5:
        raise SystemExit("--reps must be at least 5")
    torch.set_num_threads(1)
    hvd.init()
    join_gloo()
    torch.manual_seed(1 + hvd.rank())
    data, target = torch.randn(BATCH, 3072), torch.randint(0, 10, (BATCH,))
    loss_fn = torch.nn.CrossEntropyLoss()
    variants = [ddp_variant("ddp_default", 25.0, data, target, loss_fn)]
    variants += [ddp_variant(f"ddp_bucket{mb:g}mb", mb, data, target, loss_fn)
                 for mb in args.ddp_bucket_mb]
    variants.append(aiak_variant(data, target, loss_fn))
    if args.overlap:
        variants.append(aiak_variant(data, target, loss_fn, overlap=True))
    for rep in range(args.reps + 1):  # round 0 warms up
        for v in variants:
            run_block(v, args.block, timed=rep > 0)
    raw = allreduce_variants(args.allreduce_mib) if args.allreduce_mib else []
    for rep in range(args.reps + 1):
        for v in raw:
            run_block(v, 3, timed=rep > 0)
    if args.phases:
        for _ in range(args.reps):
            for v in variants:
                hvd.barrier()
                for _ in range(args.block):
                    v.phased(v.phases)
    # Each rank's CPU per step, averaged over the ranks.
    cpu = {v.name: statistics.mean(hvd.allgather_object(statistics.median(v.cpu_s),
                                                        name=f"cpu.{v.name}"))
           for v in variants + raw}
    engine_cpu = {v.name: statistics.mean(hvd.allgather_object(
        statistics.median(v.engine_cpu_s), name=f"engine_cpu.{v.name}"))
        for v in variants + raw}
    dist.destroy_process_group()
    if hvd.rank() != 0:
        return
    layout = f"{hvd.cross_size()}x{hvd.local_size()}"
    rate = link_gbit(args.link_gbit)
    tag = f"{layout}_{rate:g}gbit" if rate else layout
    machine = machine_info(ranks=hvd.size(), layout=layout, link_gbit=rate)
    results = []
    for v in variants + raw:
        entry = summarize(f"{v.name} step", {"cpu_s_per_step": cpu[v.name],
                                             "engine_cpu_s_per_step": engine_cpu[v.name]},
                          v.block_s)
        if v.phases:
            entry["params"]["phases_median_s"] = {k: statistics.median(x)
                                                  for k, x in v.phases.items()}
        results.append(entry)
    med = {v.name: statistics.median(v.block_s) for v in variants}
    best_ddp = min((n for n in med if n.startswith("ddp")), key=med.get)
    ratios = {f"aiak_vs_ddp_step_{tag}": med[best_ddp] / med["aiak"],
              f"aiak_vs_ddp_default_step_{tag}": med["ddp_default"] / med["aiak"],
              f"cpu_ddp_over_aiak_{tag}": cpu[best_ddp] / cpu["aiak"]}
    if args.overlap:
        ratios[f"aiak_overlap_vs_ddp_step_{tag}"] = med[best_ddp] / med["aiak_overlap"]
    if raw:
        aiak_s = statistics.median(raw[0].block_s)
        ratios[f"flat_allreduce_vs_gloo_{tag}"] = statistics.median(raw[1].block_s) / aiak_s
        if rate:
            # What any allreduce must move per rank: 2(n-1)/n of the buffer, at the link rate.
            n = hvd.size()
            bound_s = 2 * (n - 1) / n * args.allreduce_mib * (1 << 20) * 8 / (rate * 1e9)
            ratios[f"flat_allreduce_vs_bound_{tag}"] = bound_s / aiak_s
    machine.update(best_ddp=best_ddp)
    report("ddp_bench", machine, results, ratios, args.json)


if __name__ == "__main__":
    main()
