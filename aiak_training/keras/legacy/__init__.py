"""Horovod's Keras API for Keras 2 (``tf_keras``, or ``keras`` 2.x): what
``aiak_training.keras`` and ``aiak_training.tensorflow.keras`` export when the process
trains with Keras 2 (see ``aiak_training.keras._flavour``)."""
from aiak_training.keras.legacy import callbacks  # noqa: F401
from aiak_training.keras.legacy.optimizer import (DistributedOptimizer,  # noqa: F401
                                                  PartialDistributedOptimizer)
from aiak_training.keras.legacy.saving import (broadcast_global_variables,  # noqa: F401
                                               load_model)
