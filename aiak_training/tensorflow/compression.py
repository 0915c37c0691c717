"""Gradient compressors for TensorFlow tensors (``hvd.Compression``).

A compressor is a pair of static functions: ``compress(tensor)`` returns the tensor to send
and a context, ``decompress(tensor, context)`` turns the received tensor back.
"""
from typing import Any, Tuple

import tensorflow as tf


class Compressor:
    """Base of all compressors; both functions are static."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        """(tensor to send, context for ``decompress``)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """The value recovered from a received tensor and the context of ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are (the default)."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 and restores their type on arrival; other
    types pass through untouched."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        wire = tf.cast(tensor, tf.float16) if tensor.dtype.is_floating else tensor
        return wire, tensor.dtype

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tf.cast(tensor, ctx) if ctx.is_floating else tensor


class Compression:
    """The compressors by name: ``none`` (the default) and ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
