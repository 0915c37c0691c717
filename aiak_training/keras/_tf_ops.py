"""The TensorFlow backend of ``aiak_training.keras``.

Keras tensors are ``tf.Tensor``s here, and ``model.fit`` compiles its train step with
``tf.function``; every collective therefore goes through ``aiak_training.tensorflow``, whose
operations run eagerly and inside graphs alike.
"""
from typing import Any, List, Optional, Sequence

import keras
import tensorflow as tf

import aiak_training.tensorflow as frontend  # the Horovod-style module values go through
from aiak_training.runtime.sets.process_sets import ProcessSet
from aiak_training.tensorflow import (Adasum, Average, Compression, Max, Min,  # noqa: F401
                                      Product, Sum, ccl_built, cross_rank, cross_size,
                                      cuda_built, ddl_built, gloo_built, gloo_enabled, init,
                                      is_initialized, local_rank, local_size, mpi_built,
                                      mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                      rocm_built, shutdown, size, start_timeline,
                                      stop_timeline)


def reduce_gradients(grads: Sequence[Any], variables: Sequence[Any], scope: str,
                     **options) -> List[Any]:
    """Combine ``grads`` (tensors, ``tf.IndexedSlices`` or None) over the ranks; see
    ``aiak_training.tensorflow.allreduce_gradients`` for ``options``.  ``scope`` prefixes
    the names of the graph ops, which identify them across ranks."""
    with tf.name_scope(scope):
        return frontend.allreduce_gradients(list(grads), list(variables), **options)


def is_sparse(grad: Any) -> bool:
    return isinstance(grad, tf.IndexedSlices)


def densify(grad: Any) -> Any:
    """A dense tensor of the same value (IndexedSlices are scattered into zeros)."""
    return tf.convert_to_tensor(grad)


def divide_gradient(grad: Any, divisor: float) -> Any:
    """``grad / divisor``, keeping IndexedSlices sparse."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(divisor, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad / tf.cast(divisor, grad.dtype)


def to_tensor(value: Any) -> tf.Tensor:
    # Python floats become float32 tensors, as Horovod's Keras constants do.
    return tf.convert_to_tensor(value)


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet) -> None:
    """Overwrite Keras (or TensorFlow) variables with ``root_rank``'s values, in one
    operation."""
    frontend.broadcast_variables(list(variables), root_rank, process_set=process_set)


# A compiled TensorFlow step bakes Python hyperparameters in as constants when it is traced,
# so a later ``optimizer.momentum = x`` would not reach it; see _LiveFloat.
LIVE_HYPERPARAMETERS = True


class _LiveFloat:
    """Stands in for a float hyperparameter while the update step is traced: Python
    comparisons see the float (optimizers branch on them, e.g. on whether to keep momentum
    buffers at all), conversion to a tensor reads ``variable``, so the compiled step uses
    the value the variable has when it runs."""

    def __init__(self, value: float, variable: keras.Variable):
        self._value, self._variable = float(value), variable

    def __tf_tensor__(self, dtype: Optional[tf.DType] = None, name: Optional[str] = None):
        return tf.cast(self._variable.value, dtype or keras.backend.floatx(), name=name)

    def __float__(self) -> float:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: Any) -> bool:
        return self._value == other

    def __ne__(self, other: Any) -> bool:
        return self._value != other

    def __lt__(self, other: Any) -> bool:
        return self._value < other

    def __le__(self, other: Any) -> bool:
        return self._value <= other

    def __gt__(self, other: Any) -> bool:
        return self._value > other

    def __ge__(self, other: Any) -> bool:
        return self._value >= other

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return f"<live hyperparameter {self._value!r}>"


def live_float(value: float, variable: keras.Variable) -> Any:
    return _LiveFloat(value, variable)
