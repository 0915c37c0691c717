"""``horovod.tensorflow.keras.callbacks``: the callbacks of ``aiak_training.keras.callbacks``."""
from aiak_training.keras.callbacks import (BroadcastGlobalVariablesCallback,  # noqa: F401
                                          LearningRateScheduleCallback,
                                          LearningRateWarmupCallback, MetricAverageCallback)
