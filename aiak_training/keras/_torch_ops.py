"""The torch backend of ``aiak_training.keras``.

Keras on torch runs its train step eagerly and hands the optimizer the parameters'
``.grad`` tensors, so gradients are reduced with ``aiak_training.torch``'s grouped
allreduce, named after the optimizer so that every step hits the engine's response cache.
"""
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

import aiak_training.torch as frontend  # the Horovod-style module values go through
from aiak_training.common.grouping import group_positions
from aiak_training.runtime.sets.process_sets import ProcessSet
from aiak_training.torch import (Adasum, Average, Compression, Max, Min,  # noqa: F401
                                 Product, Sum, ccl_built, cross_rank, cross_size, cuda_built,
                                 ddl_built, gloo_built, gloo_enabled, init, is_initialized,
                                 local_rank, local_size, mpi_built, mpi_enabled,
                                 mpi_threads_supported, nccl_built, rank, rocm_built,
                                 shutdown, size, start_timeline, stop_timeline)


def reduce_gradients(grads: Sequence[Optional[torch.Tensor]], variables: Sequence[Any],
                     scope: str, compression: Any, sparse_as_dense: bool, op: int,
                     gradient_predivide_factor: float, groups: Any, process_set: ProcessSet,
                     device_dense: str = '', device_sparse: str = '') -> List[Any]:
    """Combine ``grads`` over ``process_set``, position by position (None stays None).

    The options mean what they mean for the TensorFlow backend.  Keras on torch makes no
    sparse gradients; should one come, it is reduced as a dense tensor whatever
    ``sparse_as_dense`` says.
    """
    del sparse_as_dense, device_dense, device_sparse  # dense only; tensors stay where they are
    out = [g.to_dense() if g is not None and g.is_sparse else g for g in grads]
    present = [i for i, g in enumerate(out) if g is not None]
    if not present or not process_set.included() or process_set.size() <= 1:
        return out
    # With Average the engine divides by the set size; the predivide factor moves part of
    # that division before the sum.
    pre, post = ((1.0 / gradient_predivide_factor, gradient_predivide_factor)
                 if op == Average else (1.0, 1.0))
    buckets = group_positions(present, groups, lambda i: id(variables[i]), id)
    for k, bucket in enumerate(buckets):
        reduced = frontend.grouped_allreduce([out[i] for i in bucket], name=f"{scope}.grads.{k}",
                                         compression=compression, op=op, prescale_factor=pre,
                                         postscale_factor=post, process_set=process_set)
        for i, g in zip(bucket, reduced):
            out[i] = g
    return out


def is_sparse(grad: Any) -> bool:
    return False


def densify(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad


def divide_gradient(grad: torch.Tensor, divisor: float) -> torch.Tensor:
    return grad / divisor


def to_tensor(value: Any) -> torch.Tensor:
    # Python floats become float32 tensors (torch's default), as TensorFlow's constants do.
    if torch.is_tensor(value):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.as_tensor(np.asarray(value))  # numpy values keep their dtype
    return torch.as_tensor(value)


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet) -> None:
    """Overwrite Keras variables with ``root_rank``'s values: all broadcasts are in flight
    together, then each result is assigned (assignment, not an in-place write, because
    parameters are autograd leaves)."""
    handles = [frontend.broadcast_async(v.value.detach(), root_rank, process_set=process_set)
               for v in variables]
    for variable, handle in zip(variables, handles):
        variable.assign(frontend.synchronize(handle))


# Keras runs torch steps eagerly, reading ``optimizer.momentum`` afresh at every update.
LIVE_HYPERPARAMETERS = False


def live_float(value: float, variable: Any) -> float:
    return value
