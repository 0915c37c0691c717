"""How TensorFlow tensors reach the engine, eagerly and inside ``tf.function``.

Eagerly, a collective runs at once on the tensors' own memory (an EagerTensor's numpy view
shares it) and its results become tensors through DLPack, again without a copy.

In a graph, each collective becomes one ``tf.py_function`` op that does the same when the
graph runs.  That op blocks until its collective is done, so every rank must run these ops
in one order: otherwise two ranks could each block in an operation the other has not
reached yet, with no inter-op thread left to run the one that would unblock them (the
pool has as many threads as cores).  Each op therefore depends on the collective op
created before it in the same graph, and all ranks run them in program order.  Inside
``tf.function`` TensorFlow's automatic control dependencies order stateful ops that way
already; the explicit edge also covers graphs built without them (backward functions,
``tf.compat.v1`` graphs).

XLA cannot compile a Python op, so ``jit_compile=True`` is refused while tracing, with the
op's name, instead of failing later inside XLA with an error that does not mention us.

Errors keep Horovod's TensorFlow classes in both modes (``errors``): a mismatch between
ranks is ``FailedPreconditionError`` (in a graph through the ``AiakCheckStatus`` op that
follows the collective, since a Python op can only fail as ``UnknownError``), an argument
the op cannot run with ``InvalidArgumentError``.
"""
import weakref
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util

from aiak_training.common.exceptions import HorovodInternalError
from aiak_training.common.horovod_strings import TENSOR_TYPE_NOT_SUPPORTED
from aiak_training.tensorflow.errors import (HorovodPreconditionError, framework_error,
                                             invalid_argument, status_op_module)

SUPPORTED_DTYPES = frozenset({tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64,
                              tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.bool})

# The engine function of an op: (input arrays, the op's name in its graph or None when
# eager) -> output arrays.
Compute = Callable[[List[np.ndarray], Optional[str]], Sequence[np.ndarray]]

# The collective op created last in each graph: the next one runs after it.
_last_op: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_dtype(dtype: tf.DType, what: str) -> None:
    """Refuse, naming ``what``, a tensor type that the engine cannot move."""
    if dtype.base_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{TENSOR_TYPE_NOT_SUPPORTED.format('tf.' + dtype.name)} ({what})")


def executing_eagerly() -> bool:
    return tf.executing_eagerly()


def describe(tensor, name: Optional[str]) -> str:
    """How error messages refer to an input: the op name given, else the graph tensor's
    name, else (eager tensors have none) its shape."""
    if name:
        return f"op {name}"
    if not tf.executing_eagerly() and hasattr(tensor, "name"):
        return f"tensor {tensor.name}"
    return f"eager tensor of shape {tuple(tensor.shape)}"


def op_label(text: str) -> str:
    """``text`` made into a valid op name: characters other than letters, digits and
    ``_`` become ``_``."""
    return "".join(c if (c.isascii() and c.isalnum()) or c == "_" else "_" for c in text)


def to_numpy(tensor: tf.Tensor) -> np.ndarray:
    """The eager tensor's data as a numpy array sharing its memory (read-only use)."""
    return tensor._numpy()  # pylint: disable=protected-access


def to_tensor(array: np.ndarray) -> tf.Tensor:
    """A tensor that takes over ``array``'s memory (it stays alive as long as the tensor).
    DLPack has no bfloat16, which travels as uint16 and is reinterpreted."""
    if array.dtype.name == "bfloat16":
        words = tf.experimental.dlpack.from_dlpack(array.view(np.uint16).__dlpack__())
        return tf.bitcast(words, tf.bfloat16)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def run(label: str, inputs: Sequence[tf.Tensor], compute: Compute,
        out_dtypes: Sequence[tf.DType], out_shapes: Sequence[tf.TensorShape],
        ignore_name_scope: bool = False) -> List[tf.Tensor]:
    """Run ``compute`` on ``inputs`` now (eager) or as a graph op named after ``label``;
    returns the output tensors."""
    if tf.executing_eagerly():
        try:
            outs = compute([to_numpy(t) for t in inputs], None)
        except HorovodInternalError as exc:
            raise framework_error(exc) from exc
        except ValueError as exc:
            raise invalid_argument(exc) from exc
        return [to_tensor(o) for o in outs]
    return _graph_op(op_label(label), inputs, compute, out_dtypes, out_shapes,
                     ignore_name_scope)


def _graph_op(label: str, inputs: Sequence[tf.Tensor], compute: Compute,
              out_dtypes: Sequence[tf.DType], out_shapes: Sequence[tf.TensorShape],
              ignore_name_scope: bool) -> List[tf.Tensor]:
    graph = tf_ops.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise ValueError(
            f"aiak_training collective {label} cannot run inside tf.function(jit_compile="
            "True) or another XLA-compiled function: it is a Python op, which XLA cannot "
            "compile. Call it outside the compiled function, or compile with jit_compile="
            "False (Keras: model.compile(..., jit_compile=False)).")
    engine_name: List[str] = []
    checker = status_op_module()

    def body(*tensors):
        arrays = [to_numpy(t) for t in tensors]
        try:
            outs = [to_tensor(o) for o in compute(arrays, engine_name[0])]
        except HorovodInternalError as exc:
            error = framework_error(exc)
            if checker is None or not isinstance(error, HorovodPreconditionError):
                raise error from exc
            # Placeholders: the status op fails the step before anything reads them.
            return [tf.zeros([0], dtype) for dtype in out_dtypes] + [
                tf.constant(error.error_code, tf.int32), tf.constant(str(exc))]
        if checker is None:
            return outs
        return outs + [tf.constant(0, tf.int32), tf.constant("")]

    status_dtypes = [] if checker is None else [tf.int32, tf.string]
    previous = _last_op.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        outputs = tf.py_function(body, list(inputs), list(out_dtypes) + status_dtypes,
                                 name=label)
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    op = outputs[0].op
    # Inside TF1 control flow (a v1 cond or while) the op may not run at all, and whatever
    # waited on it would not run either: the next collective orders after it only if not.
    if graph._get_control_flow_context() is None:  # pylint: disable=protected-access
        _last_op[graph] = op
    # The op's unique name in its graph identifies the collective across ranks: it is the
    # same on every rank that traced the same code.
    engine_name.append(op.name.rsplit("/", 1)[-1] if ignore_name_scope else op.name)
    if checker is not None:
        code, message = outputs[len(out_dtypes):]
        outputs = outputs[:len(out_dtypes)]
        check = checker.aiak_check_status(code, message, name=f"{label}_status")
        # Every reader of a result waits for the check, so none sees a placeholder.
        with tf.control_dependencies([check]):
            outputs = [tf.identity(t) for t in outputs]
    for tensor, shape in zip(outputs, out_shapes):
        tensor.set_shape(shape)
    return outputs
