"""Per-rank driver of tests/test_checkpoint_resume.py: training that crosses a process restart.

    mpiexec -n 2 python tests/scripts/checkpoint_resume.py PHASE DIR K [CONFIG ...]

PHASE is one of

* ``full``: train every CONFIG for 2K steps in one job; save the final model and optimizer
  state of each rank to ``DIR/full/<config>.rank<r>.pt``;
* ``first``: train K steps and write the checkpoint as a user would, then exit: DGC's
  state (residuals, velocities) differs between ranks, so every rank saves its own
  (``DIR/ckpt/dgc.rank<r>.pt``); the other configs hold identical state on every rank, so
  rank 0 alone saves ``DIR/ckpt/<config>.pt``;
* ``resume``: in a new job, build everything afresh (other initial weights), load the
  checkpoint, train steps K to 2K-1 and save the final state to ``DIR/resumed/``.  Two
  ways of loading rank 0's checkpoint are used: every rank reads the file, or (the
  ``*_bcast*`` configs) rank 0 reads it and ``hvd.broadcast_optimizer_state`` /
  ``hvd.broadcast_parameters`` hand it to the others.  Each config also saves a
  control to ``DIR/control/``: the same K steps from the checkpoint's weights with a fresh
  optimizer, which must differ from the full run if the optimizer state matters at all.

Batches depend on (step, rank) only, so a resumed job sees exactly the data the
uninterrupted one saw.
"""
import os
import sys
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F

import aiak_training.torch as hvd
from aiak_training.fused_optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

N_IN, N_HID, N_OUT = 12, 64, 4
DGC_WARMUP_STEPS = 8  # with K = 6 the warm-up's last stage starts before the checkpoint
                      # and the final density only after it


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(N_IN, N_HID), torch.nn.Tanh(),
                               torch.nn.Linear(N_HID, N_HID), torch.nn.Tanh(),
                               torch.nn.Linear(N_HID, N_HID), torch.nn.Tanh(),
                               torch.nn.Linear(N_HID, N_OUT))


def _distributed(inner: torch.optim.Optimizer, model: torch.nn.Module,
                 **kwargs) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), **kwargs)


# name -> (builder, how the checkpoint is loaded: "per_rank" (each rank its own file), "file"
# (every rank reads rank 0's), "broadcast" or "broadcast_params_first" (rank 0 reads it and
# broadcasts the optimizer state and the parameters, in one order or the other))
CONFIGS: Dict[str, Tuple[Callable[[torch.nn.Module], torch.optim.Optimizer], str]] = {
    # DGC with momentum correction (Nesterov SGD, weight decay): the 64x64 weights are
    # compressed (min_numel 1024), the first weight and the biases are reduced densely.
    "dgc": (lambda m: _distributed(
        torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                        weight_decay=1e-4), m,
        compression=hvd.Compression.dgc(density=0.01, warmup_steps=DGC_WARMUP_STEPS,
                                        min_numel=1024)), "per_rank"),
    "fused_adam": (lambda m: _distributed(FusedAdam(m.parameters(), lr=1e-2), m), "file"),
    "fused_adamw": (lambda m: _distributed(
        FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.05), m), "file"),
    "fused_adamw_bcast": (lambda m: _distributed(
        FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.05), m), "broadcast"),
    "fused_adamw_bcast_params_first": (lambda m: _distributed(
        FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.05), m), "broadcast_params_first"),
    "fused_sgd": (lambda m: _distributed(
        FusedSGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4), m), "file"),
    "fused_lamb": (lambda m: _distributed(
        FusedLAMB(m.parameters(), lr=1e-2, weight_decay=0.01), m), "file"),
    # Every completed reduction is updated on its own (AIAK_OVERLAP_MIN_BUCKET_BYTES=1 from
    # the test), so the update really is split into buckets.
    "fused_adam_overlap": (lambda m: _distributed(FusedAdam(m.parameters(), lr=1e-2), m,
                                                  overlap_update=True), "file"),
    "fused_sgd_overlap": (lambda m: _distributed(
        FusedSGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True), m,
        overlap_update=True), "file"),
}


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7_000 + 1_000 * step + hvd.rank())
    return torch.randn(8, N_IN, generator=g), torch.randn(8, N_OUT, generator=g)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def save_final(directory: str, name: str, model: torch.nn.Module,
               opt: torch.optim.Optimizer) -> None:
    extra = {}
    if hasattr(opt, "overlap_stats"):
        extra["overlap"] = opt.overlap_stats()
    if hasattr(opt, "dgc_density"):
        extra["dgc_density"] = opt.dgc_density()
    os.makedirs(directory, exist_ok=True)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "extra": extra},
               os.path.join(directory, f"{name}.rank{hvd.rank()}.pt"))


def main() -> None:
    phase, root, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    names = sys.argv[4:] or list(CONFIGS)
    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    ckpt = os.path.join(root, "ckpt")
    for name in names:
        build, loading = CONFIGS[name]
        if phase == "full":
            model = make_model(0)
            opt = build(model)
            train(model, opt, 0, 2 * k)
            save_final(os.path.join(root, "full"), name, model, opt)
        elif phase == "first":
            model = make_model(0)
            opt = build(model)
            train(model, opt, 0, k)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": k}
            if loading == "per_rank":
                os.makedirs(ckpt, exist_ok=True)
                torch.save(state, os.path.join(ckpt, f"{name}.rank{rank}.pt"))
            elif rank == 0:
                os.makedirs(ckpt, exist_ok=True)
                torch.save(state, os.path.join(ckpt, f"{name}.pt"))
        elif phase == "resume":
            for control in (False, True):
                model = make_model(100 + rank)  # different weights on every rank, at first
                opt = build(model)
                if loading == "per_rank":
                    state = torch.load(os.path.join(ckpt, f"{name}.rank{rank}.pt"))
                elif loading == "file" or rank == 0:
                    state = torch.load(os.path.join(ckpt, f"{name}.pt"))
                else:
                    state = None  # filled in by the broadcasts below
                if state is not None:
                    assert state["step"] == k
                    model.load_state_dict(state["model"])
                    if not control:
                        opt.load_state_dict(state["opt"])
                if loading == "broadcast":
                    # The optimizer state first, then the parameters: the order that was exact
                    # even before broadcast_optimizer_state put the parameters back after its
                    # state-creating step.
                    if not control:
                        hvd.broadcast_optimizer_state(opt, root_rank=0)
                    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                elif loading == "broadcast_params_first":
                    # Horovod's documented order: exact only because the state-creating step
                    # (a step on zero gradients, which AdamW's decay would let move the
                    # weights) restores the parameters it touched.
                    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                    if not control:
                        hvd.broadcast_optimizer_state(opt, root_rank=0)
                train(model, opt, k, 2 * k)
                save_final(os.path.join(root, "control" if control else "resumed"), name,
                           model, opt)
        else:
            raise SystemExit(f"unknown phase {phase!r}")
    hvd.barrier()
    hvd.shutdown()
    print(f"rank {rank}: phase {phase} done", flush=True)


if __name__ == "__main__":
    main()
