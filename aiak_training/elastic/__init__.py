"""Framework-independent core of elastic training (Horovod's ``horovod.common.elastic``).

The frontends (``aiak_training.torch.elastic``, ``aiak_training.tensorflow.elastic``,
``aiak_training.keras.elastic``) build their ``run`` decorator and state classes on
:func:`run_fn`, :class:`State` and :class:`ObjectState` from here.
"""
from aiak_training.common.exceptions import (HorovodInternalError,  # noqa: F401
                                             HostsUpdatedInterrupt)
from aiak_training.elastic.state import HostUpdateResult, ObjectState, State  # noqa: F401
from aiak_training.elastic.run import elastic_mode, run_fn  # noqa: F401
from aiak_training.elastic.worker import ElasticJobStopped, notification_manager  # noqa: F401

# In a worker of an elastic job every frontend imports this package before hvd.init(): from
# here on, each init takes its world from the driver (a no-op outside elastic mode).
from aiak_training.elastic.worker import install_world_source  # noqa: E402

install_world_source()
