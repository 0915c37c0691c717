"""The sharded strategy's step: the wrapped optimizer on this rank's shard, then the
allgathers.

``step()`` runs the wrapped optimizer on the shard only: each param group's ``params`` is
replaced, for the call, by *pieces*, views of this rank's shard buffer, one per parameter
(part) it holds, with views of the reduced shard gradient as ``.grad``.  The optimizer's
state is keyed by the pieces, so it exists for the shard only.  Each bucket's updated shard
is then allgathered straight into the parameters' storage (``allgather_async(out=)``).

FusedLAMB is not elementwise: its global clipping divides every gradient by the norm of all
of them, and each parameter's update is scaled by its trust ratio ``||p|| / ||u||``.  A
piece of a parameter alone gives neither, so :func:`step_on_pieces`, run by every rank on its
pieces:

1. sums the squares of its pieces' gradients and allreduces that one number, giving the
   global gradient norm the dense optimizer clips with;
2. advances each piece's moments and computes its update ``u`` (``lamb._lamb_update``, the
   reference arithmetic), and the partial sums of squares of the piece's weights and of ``u``;
3. allreduces one table with a row per sharded parameter (zeros where a rank holds no piece
   of it), so each row becomes the parameter's whole ``(||p||^2, ||u||^2)``: one small
   collective per step for all parameters, not one per parameter;
4. applies ``p -= lr * ratio * u`` with the whole parameter's trust ratio
   (``lamb.apply_trust_ratio``, as the reference does).

Every rank takes part in both collectives, whether it holds pieces or not.  Sums of squares
run in float64, as the dense kernels do; their order differs from the dense kernels', so the
result agrees with the dense optimizer to rounding, not bit for bit.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Dict, Iterator, List, Tuple

import torch

from aiak_training.fused_optim import _backend as B
from aiak_training.fused_optim.lamb import (FusedLAMB, _lamb_update, apply_trust_ratio,
                                            clip_divisor, clip_gradient)
from aiak_training.fused_optim._base import to_float
from aiak_training.torch.mpi_ops import Sum, allgather_async, allreduce, size


def _float64_sum(values: List[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of the squares of every element of ``values``, on the CPU."""
    total = torch.zeros((), dtype=torch.float64)
    for v in values:
        total += v.double().pow(2).sum().cpu()
    return total


@torch.no_grad()
def step_on_pieces(opt: FusedLAMB, row_of: Dict[torch.Tensor, int], rows: int,
                   name: str) -> None:
    """One FusedLAMB step of ``opt``, whose param groups list pieces of parameters, each
    mapped by ``row_of`` to its parameter's row among ``rows`` (the same on every rank).
    ``name`` prefixes the collectives' names."""
    if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
        raise RuntimeError("FusedLAMB with shard_optimizer_state=True does not take a "
                           "GradScaler's grad_scale/found_inf.")
    per_group = [(group, opt._gather(group)) for group in opt.param_groups]
    clip = 1.0
    max_grad_norm = opt.defaults.get("max_grad_norm")
    if max_grad_norm is not None and max_grad_norm > 0:
        local = _float64_sum([g for _, lists in per_group for g in lists["grads"]])
        norm = math.sqrt(float(allreduce(local.reshape(1), op=Sum, name=f"{name}.grad_norm")[0]))
        clip = clip_divisor(norm, max_grad_norm)
    # (piece, weights in opmath, update, lr, whether the trust ratio applies)
    pending: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, bool]] = []
    partial: List[torch.Tensor] = []
    for group, lists in per_group:
        beta1, beta2 = (to_float(b) for b in group["betas"])
        wd = to_float(group["weight_decay"])
        for i, piece in enumerate(lists["params"]):
            g = clip_gradient(lists["grads"][i].to(B.state_dtype(piece.dtype)), clip)
            p, u = _lamb_update(piece, g, lists["exp_avgs"][i], lists["exp_avg_sqs"][i],
                                lists["state_steps"][i], lists["master_params"][i],
                                beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                                weight_decay=wd, bias_correction=bool(group["bias_correction"]),
                                grad_averaging=bool(group["grad_averaging"]),
                                adam_w_mode=bool(group["adam_w_mode"]))
            pending.append((piece, p, u, to_float(group["lr"]),
                            wd != 0 or bool(group["use_nvlamb"])))
            partial.append(torch.stack([_float64_sum([p]), _float64_sum([u])]))
    index = torch.tensor([row_of[piece] for piece, *_ in pending], dtype=torch.long)
    table = torch.zeros(rows, 2, dtype=torch.float64)
    if pending:
        table[index] = torch.stack(partial)  # a rank holds at most one piece of a parameter
    whole = allreduce(table, op=Sum, name=f"{name}.norms")[index].tolist()
    for (piece, p, u, lr, trusted), (p_sq, u_sq) in zip(pending, whole):
        apply_trust_ratio(piece, p, u, lr,
                          (math.sqrt(p_sq), math.sqrt(u_sq)) if trusted else None)


class ShardStep:
    """The sharded strategy's ``step()`` (a part of :class:`ShardedStrategy`, which supplies
    the fields)."""

    @contextmanager
    def _on_shard(self) -> Iterator[None]:
        """Each param group lists this rank's pieces instead of the model's parameters."""
        lists: List[List[torch.Tensor]] = [[] for _ in self.param_groups]
        # On one rank the dense DistributedOptimizer is the plain optimizer, which skips a
        # parameter without gradient; on several, the missing gradient is reduced as zeros
        # (another rank may have one) and the parameter is stepped.
        alone = size() == 1
        for b in self._buckets:
            lists[b.group].extend(piece for p, _, _, piece in b.pieces
                                  if not (alone and p in b.missing))
        saved = [g["params"] for g in self.param_groups]
        try:
            for g, pieces in zip(self.param_groups, lists):
                g["params"] = pieces
            yield
        finally:
            for g, params in zip(self.param_groups, saved):
                g["params"] = params

    def step(self, closure=None):
        loss = None
        self.wait_for_parameters()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._synchronize_for_step()
        for b in self._buckets:
            b.reattach(self._parameter_names)
        with self._on_shard():
            if self._lamb_rows is None:
                self._wrapped_step()
            else:
                step_on_pieces(self, self._lamb_rows, len(self._bucket_of), "sharded.lamb")
        # Every bucket's allgather starts now, in the same order on every rank.  Each sends
        # this rank's slice from where the optimizer just updated it and writes the others'
        # into the parameters' storage, in place: no buffer, and nothing bounds how many run
        # at once.
        for b in self._gather_order:
            self._gathers[b] = allgather_async(b.mine, f"{b.name}.gather", self.process_set,
                                               out=b.storage)
        self._consolidated = None
        if not self._model_hooks:
            self.wait_for_parameters()
        return loss
