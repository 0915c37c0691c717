"""Collectives on Keras and numpy values (``hvd.allreduce(value)`` of Horovod's Keras API).

A value is anything the backend turns into a tensor: a number, a list, a numpy array or a
backend tensor.  Python numbers become float32/int32 tensors, as Horovod's Keras constants
do.  Results are tensors of the backend (``tf.Tensor`` or ``torch.Tensor``); pass them to
``keras.ops.convert_to_numpy`` for numpy.
"""
from typing import Any, Optional

from aiak_training.keras import _backend

_ops = _backend.adapter()
Compression = _ops.Compression


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Optional[int] = None, compression: Any = Compression.none) -> Any:
    """Combine ``value`` (same shape on every rank) over all ranks with ``op`` (Average if
    None; ``average`` is the deprecated form), scaled by the two factors."""
    return _ops.frontend.allreduce(_ops.to_tensor(value), average=average, name=name, op=op,
                                   prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, compression=compression)


def allgather(value: Any, name: Optional[str] = None) -> Any:
    """Every rank's ``value`` concatenated along the first dimension, in rank order (the
    first dimension may differ between ranks)."""
    return _ops.frontend.allgather(_ops.to_tensor(value), name=name)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> Any:
    """``root_rank``'s ``value`` on every rank."""
    return _ops.frontend.broadcast(_ops.to_tensor(value), root_rank, name=name)


def reducescatter(value: Any, name: Optional[str] = None, op: int = _ops.Average) -> Any:
    """Combine ``value`` over all ranks with ``op`` and keep this rank's block of rows."""
    return _ops.frontend.reducescatter(_ops.to_tensor(value), name=name, op=op)
