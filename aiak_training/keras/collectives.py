"""The collectives of Horovod's Keras API: on Keras and numpy values (``hvd.allreduce(value)``)
and on the global variables (``broadcast_global_variables``).

A value is anything the backend turns into a tensor: a number, a list, a numpy array or a
backend tensor.  Python numbers become float32/int32 tensors, as Horovod's Keras constants
do.  Results are tensors of the backend (``tf.Tensor`` or ``torch.Tensor``); pass them to
``keras.ops.convert_to_numpy`` for numpy.

The global variables.  TensorFlow 1 kept every variable in a graph-wide collection, and
Horovod broadcast that.  Keras 3 has no such collection, so here the global variables are,
by definition, the state of the Keras models alive in this process:

* each model's weights (``model.weights``: trainable and non-trainable ones such as batch
  normalization statistics; not the seed state of dropout and other random layers, so that
  ranks keep drawing their own masks, and not metric accumulators);
* after them, the variables of the model's optimizer if it is built (iteration count,
  learning rate, slots such as momentum).

Models are found by a sweep of the garbage collector's objects, after a collection (so a
model the program dropped does not count), and taken in the order of their names: a
program gives them the same names on every rank (Keras numbers default names in creation
order).  Two live models with one name would leave that order open, which is an error.  A
variable reached from several models (shared layers, nested models) is sent once, at its
first place.
"""
from typing import Any, List, Optional

import keras

from aiak_training.keras import _backend, _flavour
from aiak_training.runtime.diagnostics.call_origin import collective_helper
from aiak_training.runtime.sets.process_sets import global_process_set

_ops = _backend.adapter()
Compression = _ops.Compression


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Optional[int] = None, compression: Any = Compression.none) -> Any:
    """Combine ``value`` (same shape on every rank) over all ranks with ``op`` (Average if
    None; ``average`` is the deprecated form), scaled by the two factors."""
    return _ops.frontend.allreduce(_ops.to_tensor(value), average=average, name=name, op=op,
                                   prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, compression=compression)


def allgather(value: Any, name: Optional[str] = None) -> Any:
    """Every rank's ``value`` concatenated along the first dimension, in rank order (the
    first dimension may differ between ranks)."""
    return _ops.frontend.allgather(_ops.to_tensor(value), name=name)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> Any:
    """``root_rank``'s ``value`` on every rank."""
    return _ops.frontend.broadcast(_ops.to_tensor(value), root_rank, name=name)


def reducescatter(value: Any, name: Optional[str] = None, op: int = _ops.Average) -> Any:
    """Combine ``value`` over all ranks with ``op`` and keep this rank's block of rows."""
    return _ops.frontend.reducescatter(_ops.to_tensor(value), name=name, op=op)


def global_variables() -> List[Any]:
    """The global variables (see the module's description), in broadcast order."""
    seen, out = set(), []
    for model in _flavour.live_models(keras):
        state = list(model.weights)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            state += list(optimizer.variables)
        for variable in state:
            if id(variable) not in seen:
                seen.add(id(variable))
                out.append(variable)
    return out


@collective_helper("broadcast_global_variables")
def broadcast_global_variables(root_rank: int) -> None:
    """Overwrite every global variable (the weights of all live Keras models, then their
    optimizers' variables; see this module) with ``root_rank``'s values.  Every rank must
    call it with the same models alive and built: it is a collective (by default, a call on
    some ranks only stops the job with a deadlock error naming this function)."""
    variables = global_variables()
    if variables:
        _ops.broadcast_variables(variables, root_rank, global_process_set)
