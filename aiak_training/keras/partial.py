"""``PartialDistributedOptimizer`` for Keras 3 (``horovod.keras`` and
``horovod.tensorflow.keras`` have it): a ``DistributedOptimizer`` whose local layers keep
their gradients on each rank."""
from typing import Any, Optional

import keras

from aiak_training.keras import _flavour
from aiak_training.keras.optimizer import Average, Compression, DistributedOptimizer
from aiak_training.runtime.process_sets import ProcessSet, global_process_set


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                                device_dense: str = '', device_sparse: str = '',
                                compression: Any = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                groups: Optional[Any] = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers=None,
                                scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """:func:`DistributedOptimizer` whose ``local_layers`` (a Keras layer or a list of them)
    keep their trainable weights' gradients local: not combined over the ranks, and divided
    by the process set's size when ``scale_local_gradients``."""
    layers = _flavour.local_layers(local_layers, keras)
    wrapped = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in layers:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped
