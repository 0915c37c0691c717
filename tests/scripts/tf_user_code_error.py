"""A Horovod TensorFlow 2 idiom that Keras 3 breaks inside ``tf.function``: ``opt.variables``
is a list there, so calling it raises TensorFlow's multi-line "in user code:" TypeError
(tests/test_failure_messages.py checks that aiakrun's summary names the real cause)."""
import tensorflow as tf
import aiak_training.tensorflow as hvd
hvd.init()
opt = tf.keras.optimizers.SGD(0.1)

@tf.function
def step():
    hvd.broadcast_variables(opt.variables(), root_rank=0)

step()
