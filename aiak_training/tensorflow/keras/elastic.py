"""``horovod.tensorflow.keras.elastic``: the Keras elastic API of ``aiak_training.keras``."""
from aiak_training.keras.elastic import (CommitStateCallback, KerasState,  # noqa: F401
                                         ObjectState, State, TensorFlowKerasState,
                                         UpdateBatchStateCallback,
                                         UpdateEpochStateCallback, run)
