"""SyncBatchNorm: batch statistics computed over every rank's batch."""
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from aiak_training.runtime.process_sets import global_process_set
from aiak_training.torch.mpi_ops import Sum, allreduce, size


class SyncBatchNorm(_BatchNorm):
    """Applies synchronous version of N-dimensional BatchNorm.

    In this version, normalization parameters are synchronized across workers during forward
    pass. This is very useful in situations where each GPU can fit a very small number of
    examples.

    See https://pytorch.org/docs/stable/nn.html#batchnorm2d for more details about
    BatchNorm.

    Arguments:
        num_features: number of channels `C` from the shape `(N, C, ...)`
        eps: a value added to the denominator for numerical stability. Default: 1e-5
        momentum: the value used for the running_mean and running_var
            computation. Can be set to `None` for cumulative moving average
            (i.e. simple average). Default: 0.1
        affine: a boolean value that when set to `True`, this module has
            learnable affine parameters. Default: `True`
        track_running_stats: a boolean value that when set to `True`, this
            module tracks the running mean and variance, and when set to `False`,
            this module does not track such statistics and always uses batch
            statistics in both training and eval modes. Default: `True`

    .. note:: Only supports input tensors with rank >= 2. Gradients flow through the
        cross-rank reductions, so backward is exact as well.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got {}D input)".format(input.dim()))

    def _run_bn(self, input, running_mean=None, running_var=None, training=False):
        return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                            training, self.momentum or 0.0, self.eps)

    def forward(self, input):
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked = self.num_batches_tracked + 1
        exponential_average_factor = self.momentum
        if self.momentum is None and self.training and self.track_running_stats:
            exponential_average_factor = 1.0 / float(self.num_batches_tracked)

        if not self.training and self.track_running_stats:
            return self._run_bn(input, self.running_mean, self.running_var, False)
        # Batch statistics: in training, and (as in Horovod) in evaluation without running
        # statistics, where they are synchronized too.
        if size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, True, exponential_average_factor or 0.0, self.eps)

        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        local_count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        # Two-pass statistics: the global mean first, then the centred sum of squares, which is
        # numerically safer than E[x^2] - E[x]^2.  Gradients flow through both reductions.
        sums = allreduce(torch.cat([x.sum(dims), local_count]), op=Sum,
                         name=None, process_set=self.process_set)
        count = sums[-1]
        mean = sums[:-1] / count
        centred = x - mean.view(shape)
        var = allreduce((centred * centred).sum(dims), op=Sum, process_set=self.process_set) / count
        out = centred / torch.sqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)

        if self.track_running_stats:
            with torch.no_grad():
                n = float(count)
                unbiased = var.detach() * (n / max(n - 1.0, 1.0))
                f = exponential_average_factor
                self.running_mean.mul_(1 - f).add_(mean.detach().to(self.running_mean.dtype), alpha=f)
                self.running_var.mul_(1 - f).add_(unbiased.to(self.running_var.dtype), alpha=f)
        return out.to(input.dtype)
