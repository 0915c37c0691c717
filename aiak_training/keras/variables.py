"""The global variables of a Keras 3 program, and ``broadcast_global_variables``.

TensorFlow 1 kept every variable in a graph-wide collection, and Horovod broadcast that.
Keras 3 has no such collection, so here the global variables are, by definition, the state
of the Keras models alive in this process:

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
from typing import Any, List

import keras

from aiak_training.keras import _backend, _flavour
from aiak_training.runtime.call_origin import collective_helper
from aiak_training.runtime.process_sets import global_process_set

_ops = _backend.adapter()


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
