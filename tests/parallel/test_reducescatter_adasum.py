"""``reducescatter(..., op=Adasum)`` is refused with Horovod's ``RuntimeError`` (our
``NotImplementedError``, a subclass) for every dtype, before any dtype check, on every
frontend: torch, TensorFlow and Keras 3's values.  Every rank runs this file: once with
AIAK_TEST_FRONTEND=tensorflow and KERAS_BACKEND=tensorflow, once on torch with
KERAS_BACKEND=torch (tests/test_fidelity_issue30.py).  After the refusals the ranks still
agree: a plain reducescatter right after gives the exact sums.
"""
import importlib.util
import os

import numpy as np
import pytest

from aiak_training.allreduce.adasum import NOT_FOR_REDUCESCATTER

TENSORFLOW = os.environ.get("AIAK_TEST_FRONTEND") == "tensorflow"
# Integers (the regression: Adasum's dtype check answered ValueError), bool, floating point.
DTYPES = ["int8", "uint8", "int32", "int64", "bool", "float16", "float32", "float64"]


def refused(call, traced=False):
    """``call()`` raises the reducescatter refusal, as a RuntimeError, with our message
    (which tf.function's tracing prefixes with the user code it was in)."""
    with pytest.raises(RuntimeError) as err:
        call()
    assert type(err.value) is NotImplementedError
    if traced:
        assert str(err.value).rstrip().endswith(NOT_FOR_REDUCESCATTER), str(err.value)
    else:
        assert str(err.value) == NOT_FOR_REDUCESCATTER


def exact_after(hvd, make):
    """The ranks still agree: Sum of rows (rank + 1) * [0..5] keeps this rank's 3 rows."""
    n, me = hvd.size(), hvd.rank()
    rows = 3 * n
    out = hvd.reducescatter(make(np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
                                 * (me + 1)), op=hvd.Sum)
    full = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * sum(range(1, n + 1))
    np.testing.assert_array_equal(np.asarray(out), full[3 * me:3 * me + 3])


@pytest.mark.skipif(TENSORFLOW, reason="the torch run covers the torch frontend")
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_refuses_adasum_for_every_dtype(dtype):
    import torch
    import aiak_training.torch as hvd
    tensor = torch.ones(4, 2).to(getattr(torch, dtype))
    refused(lambda: hvd.reducescatter(tensor, op=hvd.Adasum))
    refused(lambda: hvd.reducescatter(tensor, op=hvd.Adasum,
                                      compression=hvd.Compression.fp16))
    refused(lambda: hvd.reducescatter_async(tensor, op=hvd.Adasum))
    refused(lambda: hvd.grouped_reducescatter([tensor, tensor], op=hvd.Adasum))
    refused(lambda: hvd.grouped_reducescatter_async([tensor], op=hvd.Adasum))
    exact_after(hvd, torch.from_numpy)


@pytest.mark.skipif(not TENSORFLOW, reason="the TensorFlow run covers it")
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensorflow_refuses_adasum_for_every_dtype(dtype):
    import tensorflow as tf
    import aiak_training.tensorflow as hvd
    tensor = tf.ones((4, 2), dtype=getattr(tf, dtype))
    refused(lambda: hvd.reducescatter(tensor, op=hvd.Adasum))
    refused(lambda: hvd.grouped_reducescatter([tensor, tensor], op=hvd.Adasum))

    @tf.function
    def traced():
        return hvd.reducescatter(tensor, op=hvd.Adasum)
    refused(traced, traced=True)
    exact_after(hvd, tf.constant)


@pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="Keras 3 not installed")
@pytest.mark.parametrize("dtype", ["int32", "int64", "float32"])
def test_keras_values_refuse_adasum_for_every_dtype(dtype):
    """``aiak_training.keras.reducescatter`` of a value, on whichever backend this run has."""
    import aiak_training.keras as hvd
    value = np.ones((4, 2), dtype=dtype)
    refused(lambda: hvd.reducescatter(value, op=hvd.Adasum))
    exact_after(hvd, lambda a: a)
