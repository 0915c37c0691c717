"""``horovod.tensorflow.keras.callbacks``: the callbacks of ``aiak_training.keras.callbacks``
(Keras 3), or of ``aiak_training.keras.legacy.callbacks`` when the process trains with
Keras 2."""
from aiak_training.keras import _flavour

if _flavour.legacy() is None:
    from aiak_training.keras.callbacks import (BroadcastGlobalVariablesCallback,  # noqa: F401
                                              LearningRateScheduleCallback,
                                              LearningRateWarmupCallback,
                                              MetricAverageCallback)
else:
    from aiak_training.keras.legacy.callbacks import (  # noqa: F401
        BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
        LearningRateWarmupCallback, MetricAverageCallback)
