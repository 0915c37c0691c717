"""The collectives a Lightning strategy answers for, on aiak-training's runtime.

Lightning asks a strategy to reduce logged values (``self.log(..., sync_dist=True)``), to
stack a tensor from every rank (``LightningModule.all_gather``), to broadcast Python objects
(checkpoint paths, early-stopping decisions) and to wait at barriers.  torchmetrics asks for
one more: every rank's copy of each metric state (``dist_sync_fn``), which it reads through
``torch.distributed`` unless a metric is told otherwise; :func:`attach_metrics` tells it.
"""
from __future__ import annotations

from typing import Any, List, Optional, Union

import torch

import aiak_training.torch as hvd

# Lightning's reduce_op spellings (strings, or torch.distributed.ReduceOp members whose
# names end in these words) -> the runtime's reduction.
_OPS = {"mean": hvd.Average, "avg": hvd.Average, "average": hvd.Average, "sum": hvd.Sum,
        "max": hvd.Max, "min": hvd.Min, "product": hvd.Product, "prod": hvd.Product}


def reduce_op(op: Any) -> int:
    """The runtime's reduction for Lightning's ``reduce_op`` (``"mean"``, ``"sum"``,
    ``ReduceOp.SUM``, ...; None means mean)."""
    if op is None:
        return hvd.Average
    word = op.lower() if isinstance(op, str) else str(op).rsplit(".", 1)[-1].lower()
    try:
        return _OPS[word]
    except KeyError:
        raise ValueError(f"reduce_op={op!r} is not supported; use one of "
                         f"{', '.join(sorted(_OPS))}") from None


def process_set(group: Any) -> hvd.ProcessSet:
    """Lightning's ``group``: None (every rank) or an aiak-training ProcessSet."""
    if group is None:
        return hvd.global_process_set
    if isinstance(group, hvd.ProcessSet):
        return group
    raise ValueError(f"group={group!r}: the aiak strategy takes None or an "
                     "aiak_training.torch.ProcessSet (torch.distributed groups do not exist "
                     "here)")


def reduce(tensor: Union[torch.Tensor, Any], group: Any = None,
           op: Any = "mean") -> Union[torch.Tensor, Any]:
    """Reduce ``tensor`` over the ranks (anything else is returned as it is).  An integer
    tensor is averaged as float, as torch.distributed-based strategies do."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    how = reduce_op(op)
    if how == hvd.Average and not tensor.is_floating_point():
        tensor = tensor.float()
    return hvd.allreduce(tensor, op=how, process_set=process_set(group))


def all_gather(tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension (all ranks give the same
    shape).  With ``sync_grads`` the result is differentiable."""
    members = process_set(group)
    if sync_grads:
        return hvd.allgather(tensor.unsqueeze(0), process_set=members)
    with torch.no_grad():
        return hvd.allgather(tensor.unsqueeze(0), process_set=members)


def gather_all_tensors(tensor: torch.Tensor, group: Optional[Any] = None) -> List[torch.Tensor]:
    """Every rank's ``tensor``, one list entry per rank: torchmetrics' ``dist_sync_fn``.
    Shapes may differ between ranks (a list state holds as many rows as the rank saw)."""
    if group is not None:
        raise ValueError("the aiak strategy gathers torchmetrics states over all ranks only "
                         "(process_group=None)")
    shapes = hvd.allgather_object(tuple(tensor.shape))
    flat = hvd.allgather(tensor.detach().reshape(-1).contiguous())
    out, start = [], 0
    for shape in shapes:
        count = 1
        for dim in shape:
            count *= dim
        out.append(flat[start:start + count].reshape(shape))
        start += count
    return out


def _everywhere() -> bool:
    return hvd.is_initialized() and hvd.size() > 1


def attach_metrics(module: torch.nn.Module) -> int:
    """Point every torchmetrics ``Metric`` inside ``module`` at :func:`gather_all_tensors`
    (their ``compute()`` then combines all ranks' states); returns how many there were."""
    try:
        from torchmetrics import Metric
    except ImportError:
        return 0
    count = 0
    for sub in module.modules():
        if isinstance(sub, Metric):
            sub.dist_sync_fn = gather_all_tensors
            sub.distributed_available_fn = _everywhere
            count += 1
    return count


def broadcast(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it, on every rank."""
    return hvd.broadcast_object(obj, root_rank=src)


def barrier() -> None:
    """Wait for every rank."""
    hvd.barrier()
