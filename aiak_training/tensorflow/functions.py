"""Bringing every rank to the same state: variables and picklable Python objects (the
``horovod.tensorflow.functions`` API).

Objects are moved by ``aiak_training.runtime.arrays.objects`` as pickled bytes, directly on numpy
arrays: they run when called, so inside ``tf.function`` they run once, while tracing.
``session`` arguments exist for TensorFlow 1 compatibility and are ignored.
"""
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from aiak_training.runtime.arrays import objects
from aiak_training.runtime.diagnostics.call_origin import collective_helper
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.tensorflow import mpi_ops


@collective_helper("broadcast_variables")
def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Optional[tf.Operation]:
    """Overwrite ``variables`` with their values on ``root_rank`` (a global rank of
    ``process_set``, all ranks by default).

    All variables travel in one operation, matched across ranks by list position, so
    every member passes the same list.  ``inplace`` is accepted for compatibility: the
    values are always assigned to the variables.  Eagerly the assignment is done on return
    (None is returned); in a graph, the op that does it is returned.

    A collective: every member of ``process_set`` must call it, or the others wait for it
    (by default the job then stops with a deadlock error naming this function).
    """
    del inplace  # every broadcast here ends in an assignment to the variable
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.group()
    values = mpi_ops._broadcast_group([tf.convert_to_tensor(v) for v in variables],
                                      root_rank, True, None, False, process_set)
    # Keras 3 variables return the new value from assign(), not an op: tf.function runs the
    # assignment anyway, as it runs every stateful op.
    updates = [u for u in (v.assign(x) for v, x in zip(variables, values)) if u is not None]
    return None if tf.executing_eagerly() else tf.group(*updates)


@collective_helper("broadcast_object")
def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every member of ``process_set``.

    A collective: every member must call it, or the others wait for it (by default
    the job then stops with a deadlock error naming this function).

    Arguments:
        obj: any object cloudpickle can serialize; only the root's value matters.
        root_rank: the global rank that sends; it must belong to ``process_set``.
        session: ignored (TensorFlow 1).
        name: the operation's name; by default the name of ``type(obj)``, so all ranks
            must pass objects of one type or give a name.
        process_set: the ranks taking part.

    Returns:
        On the root, ``obj`` itself; elsewhere an unpickled copy of it.
    """
    del session
    name = name or type(obj).__name__
    return objects.broadcast_object(obj, root_rank, f"broadcast_object.{name}", process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set
                        ) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from ``root_rank`` each time it is called
    (Horovod builds the graph for it once, for TensorFlow 1 sessions; eagerly there is
    nothing to build).  Every call on every member must be matched by one on the others."""
    del session
    base = name or "broadcast_object_fn"

    @collective_helper("broadcast_object_fn")
    def broadcast(obj: Any) -> Any:
        return objects.broadcast_object(obj, root_rank, f"broadcast_object.{base}",
                                        process_set)
    return broadcast


@collective_helper("allgather_object")
def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Every member's ``obj`` (cloudpickle-serializable), as a list in rank order of
    ``process_set`` (unpickled copies, this rank's too).  ``name`` defaults to the name of
    ``type(obj)``; ``session`` is ignored.

    A collective: every member must call it, or the others wait for it (by default
    the job then stops with a deadlock error naming this function)."""
    del session
    name = name or type(obj).__name__
    return objects.allgather_object(obj, f"allgather_object.{name}", process_set)
