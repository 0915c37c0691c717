"""SyncBatchNorm: batch normalization whose statistics span the batches of all ranks."""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from aiak_training.common import horovod_strings as hs
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.torch.mpi_ops import Sum, allreduce, size


def _channel_layout(ndim: int) -> Tuple[List[int], List[int]]:
    """For an ``(N, C, ...)`` input: the dimensions reduced per channel, and the shape that
    broadcasts a length-``C`` vector against the input."""
    return [0, *range(2, ndim)], [1, -1, *([1] * (ndim - 2))]


def _global_moments(x: torch.Tensor, dims: List[int], shape: List[int], process_set: ProcessSet
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance over every member's batch, ``x`` minus that
    mean, and the element count per channel.

    The variance takes a second reduction of squares around the global mean, rather than
    E[x^2] - E[x]^2, which cancels badly when the mean is large.  Both reductions are the
    differentiable allreduce, so gradients reach every rank's input.
    """
    per_channel = x.numel() // x.shape[1]
    count_entry = torch.tensor([per_channel], dtype=x.dtype, device=x.device)
    totals = allreduce(torch.cat([x.sum(dims), count_entry]), op=Sum, name=None,
                       process_set=process_set)
    count = totals[-1]
    mean = totals[:-1] / count
    deviation = x - mean.view(shape)
    square_sum = allreduce((deviation * deviation).sum(dims), op=Sum, process_set=process_set)
    return mean, square_sum / count, deviation, count


class SyncBatchNorm(_BatchNorm):
    """Batch normalization for data parallel training with small per-rank batches: the mean
    and variance are taken over the union of the batches of ``process_set``'s members, as
    if one process saw the whole batch.  Backward is exact too, since the statistics are
    computed with differentiable allreduces.

    Arguments (as for ``torch.nn.BatchNorm*d``):
        num_features: ``C``, the size of dimension 1 of an ``(N, C, ...)`` input.
        eps: added to the variance before the square root.  Default ``1e-5``.
        momentum: weight of the newest batch in ``running_mean`` / ``running_var``; ``None``
            weighs all batches seen so far equally.  Default ``0.1``.
        affine: learn a per-channel scale and shift.  Default ``True``.
        track_running_stats: keep running statistics and normalize with them in eval mode.
            When ``False`` there are none, and batch statistics (synchronized across the
            ranks) are used in eval mode as well.  Default ``True``.
        process_set: the ranks whose batches are combined.  Default: all ranks.

    Inputs must have at least two dimensions.  With more than one rank, half and bfloat16
    inputs are normalized in float32 and the result is cast back.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(hs.SYNC_BATCH_NORM_INPUT_DIM.format(input.dim()))

    def _update_weight(self) -> float:
        """Count this batch if it feeds the running statistics, and return the weight it
        gets in them (a cumulative average when ``momentum`` is None)."""
        if not (self.training and self.track_running_stats):
            return self.momentum or 0.0
        self.num_batches_tracked = self.num_batches_tracked + 1
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        weight = self._update_weight()
        if self.track_running_stats and not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, weight, self.eps)
        if size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, True, weight, self.eps)
        return self._normalize_across_ranks(input, weight)

    def _normalize_across_ranks(self, input: torch.Tensor, weight: float) -> torch.Tensor:
        dims, shape = _channel_layout(input.dim())
        low_precision = input.dtype in (torch.float16, torch.bfloat16)
        x = input.float() if low_precision else input
        mean, var, deviation, count = _global_moments(x, dims, shape, self.process_set)
        out = deviation / torch.sqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._blend_running_stats(mean, var, float(count.detach()), weight)
        return out.to(input.dtype)

    @torch.no_grad()
    def _blend_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: float,
                             weight: float) -> None:
        # The running variance is unbiased (n - 1 in the denominator), as in torch's
        # BatchNorm; normalization itself uses the biased one.
        unbiased = var.detach() * (n / max(n - 1.0, 1.0))
        for running, batch in ((self.running_mean, mean.detach()), (self.running_var, unbiased)):
            running.mul_(1 - weight).add_(batch.to(running.dtype), alpha=weight)
