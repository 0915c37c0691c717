"""``hvd.DistributedOptimizer(tf.compat.v1.train.Optimizer, op=hvd.Adasum)``: the delta
optimizer for TensorFlow's legacy optimizers, with the behaviour of Horovod 0.28.1's
``_DistributedAdasumOptimizer``.

Gradients are not reduced.  Each rank applies its own gradients with the wrapped optimizer
(``compute_gradients`` is the wrapped one's, unchanged), and every ``backward_passes_per_step``
applications the change of each variable since the last communication is Adasum-allreduced:

    start = var                    (kept in a local variable, set on the first step)
    var <- local optimizer update  (every step)
    on every N-th step:  start += Adasum(var - start);  var = start

Optimizer slots (momentum, Adam moments) stay local to each rank.  The changes of all
variables go in one grouped allreduce, which keeps per-tensor coefficients (the same result as
one allreduce per variable, Horovod's way).  Works eagerly, in ``tf.function`` and in TF1
graphs (resource variables).  Keras optimizers have no Adasum path, as in Horovod.
"""
from typing import Any, Dict, List, Optional, Type

import tensorflow as tf

from aiak_training.tensorflow.compression import Compressor
from aiak_training.tensorflow.mpi_ops import Adasum
from aiak_training.tensorflow.reductions import grouped_allreduce

_LegacyOptimizer = tf.compat.v1.train.Optimizer


class DistributedAdasumOptimizer(_LegacyOptimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer`` (see the module docstring)."""

    def __init__(self, optimizer: _LegacyOptimizer, name: Optional[str] = None,
                 use_locking: bool = False, device_dense: str = '', device_sparse: str = '',
                 compression: Optional[Type[Compressor]] = None,
                 backward_passes_per_step: int = 1):
        if name is None:
            name = f"DistributedDelta{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._device_dense, self._device_sparse = device_dense, device_sparse
        self._compression = compression
        self._passes = backward_passes_per_step
        self._starts: Dict[Any, tf.Variable] = {}
        self._count: Optional[tf.Variable] = None

    def _key(self, var) -> Any:
        return var.ref() if hasattr(var, "ref") else id(var)

    def _state(self, variables: List[tf.Variable]) -> List[tf.Variable]:
        """The start copies of ``variables`` and the step counter, made on first use outside
        any function being traced (they live across steps; local, not saved as trainable)."""
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        with tf.init_scope():
            if self._count is None:
                self._count = tf.compat.v1.Variable(0, dtype=tf.int64, trainable=False,
                                                    collections=local, use_resource=True,
                                                    name="aiak_adasum_step")
            for v in variables:
                if self._key(v) not in self._starts:
                    self._starts[self._key(v)] = tf.compat.v1.Variable(
                        tf.zeros(v.shape, v.dtype.base_dtype), trainable=False,
                        collections=local, use_resource=True, name="aiak_delta_start")
        return [self._starts[self._key(v)] for v in variables]

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's local gradients: with Adasum the updates are combined, not
        the gradients."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Apply the local gradients; on every ``backward_passes_per_step``-th call, replace
        each variable by its start plus the Adasum of every rank's change since then."""
        pairs = list(grads_and_vars)
        variables = [v for g, v in pairs if g is not None]
        starts = self._state(variables)
        count = self._count

        def remember_start():
            return tf.group(*[s.assign(v) for s, v in zip(starts, variables)])

        first = tf.cond(tf.equal(count, 0), remember_start, tf.no_op)
        with tf.control_dependencies([first]):
            applied = self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
        with tf.control_dependencies([applied]):
            is_comm = tf.equal(tf.math.floormod(count, self._passes), self._passes - 1)

            def communicate():
                deltas = [v - s for v, s in zip(variables, starts)]
                options = {} if self._compression is None else {"compression": self._compression}
                combined = grouped_allreduce(deltas, device_dense=self._device_dense,
                                             device_sparse=self._device_sparse, op=Adasum,
                                             **options)
                moved = [s.assign_add(c) for s, c in zip(starts, combined)]
                with tf.control_dependencies(moved):
                    return tf.group(*[v.assign(s) for v, s in zip(variables, starts)])

            synced = tf.cond(is_comm, communicate, tf.no_op)
        with tf.control_dependencies([synced]):
            step = count.assign_add(1)
        return step if tf.executing_eagerly() else step.op

    def get_slot(self, var, name):
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        return self._optimizer.get_slot_names()

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
