"""SyncBatchNormalization: Keras batch normalization whose training statistics span the
batches of every rank."""
import keras
import tensorflow as tf

from aiak_training.common.horovod_strings import SYNC_BATCH_NORM_FUSED
from aiak_training.tensorflow.mpi_ops import Sum, _allreduce, size


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` for data-parallel training with small per-rank
    batches: in training, the mean and variance are taken over the union of all ranks'
    batches (masked positions excluded), as if one process saw the whole batch.  The
    statistics come from differentiable allreduces, so gradients are exact too.

    Ranks may have different batch sizes.  Inference uses the moving statistics, which
    every rank updates alike.  ``fused`` must stay False (Horovod's rule).
    """

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError(SYNC_BATCH_NORM_FUSED)
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        if size() == 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        if mask is None:
            weights = tf.ones_like(inputs)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)),
                              inputs.dtype)
        # Two reductions: the global sum and count give the mean, then the squared
        # deviations from that mean give the variance (no E[x^2] - E[x]^2 cancellation).
        local_sum = tf.reduce_sum(inputs * weights, axes, keepdims=True)
        local_count = tf.reduce_sum(weights, axes, keepdims=True)
        totals = _allreduce(tf.stack([local_sum, local_count]), op=Sum)
        count = tf.maximum(totals[1], 1.0)
        mean = totals[0] / count
        squares = tf.reduce_sum(tf.square(inputs - mean) * weights, axes, keepdims=True)
        variance = _allreduce(squares, op=Sum) / count
        return tf.squeeze(mean, axes), tf.squeeze(variance, axes)
