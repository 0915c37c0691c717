"""Combining gradients across ranks: the building block of every distributed optimizer, and
``DistributedGradientTape``.

:func:`allreduce_gradients` takes a list of gradients as TensorFlow produces them (None for
variables that got none, ``tf.IndexedSlices`` for sparse ones) and returns them combined
over a process set.  Dense gradients travel together as one grouped allreduce (one
submission, so the engine fuses them, and one graph op); sparse ones are gathered.
"""
from typing import Any, Dict, List, Optional, Sequence, Type, Union

import tensorflow as tf

from aiak_training.common import horovod_strings as hs
from aiak_training.common.grouping import fold_num_groups
from aiak_training.common.grouping import LocalGradients, group_positions
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.tensorflow.compression import Compression, Compressor
from aiak_training.tensorflow.mpi_ops import Average
from aiak_training.tensorflow.reductions import grouped_allreduce

Gradient = Optional[Union[tf.Tensor, tf.IndexedSlices]]
Groups = Optional[Union[int, List[List[tf.Variable]]]]


def check_gradient_options(op: int, gradient_predivide_factor: float, num_groups: int,
                           groups: Groups) -> Groups:
    """Validate the options every distributed optimizer shares; returns ``groups`` with the
    deprecated ``num_groups`` folded in."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(hs.PREDIVIDE_NEEDS_AVERAGE)
    return fold_num_groups(num_groups, groups)


def source_key(source) -> object:
    """A hashable identity for a variable or watched tensor (Keras 3 variables have no
    ``ref()``; they are keyed by identity, which the caller's references keep valid)."""
    return source.ref() if hasattr(source, "ref") else id(source)


def _buckets(present: List[int], variables: Optional[Sequence], groups: Groups
             ) -> List[List[int]]:
    """Which gradients (positions in ``present`` order) travel together
    (:func:`aiak_training.common.grouping.group_positions`)."""
    if isinstance(groups, list) and variables is None:
        raise ValueError("groups given as lists of variables need the variables of the "
                         "gradients.")
    return group_positions(present, groups, lambda i: source_key(variables[i]), source_key)


def allreduce_gradients(gradients: Sequence[Gradient], variables: Optional[Sequence] = None,
                        device_dense: str = '', device_sparse: str = '',
                        compression: Type[Compressor] = Compression.none,
                        sparse_as_dense: bool = False, op: int = Average,
                        gradient_predivide_factor: float = 1.0, groups: Groups = None,
                        process_set: ProcessSet = global_process_set,
                        use_generic_names: bool = False) -> List[Gradient]:
    """Combine each rank's ``gradients`` over ``process_set``, position by position.

    Arguments:
        gradients: tensors, ``tf.IndexedSlices`` or None (kept as None).
        variables: the variables the gradients belong to (needed when ``groups`` lists
            variables).
        device_dense, device_sparse, compression: as for ``hvd.allreduce``.
        sparse_as_dense: turn IndexedSlices into dense tensors and reduce those.
        op: Average (default), Sum, Min, Max or Product (IndexedSlices: Average or Sum).
        gradient_predivide_factor: with Average, divide by it before the sum and multiply
            by ``factor / size`` after it.
        groups: None (all gradients in one operation), a number of operations to spread
            them over, or lists of variables whose gradients travel together (each other
            gradient on its own).
        process_set: the ranks to combine over; gradients are returned unchanged on a rank
            outside it, or when it has a single rank.
        use_generic_names: name the operations ``grad_<n>`` without name scope.

    Returns:
        A list like ``gradients``: averaged dense tensors, gathered IndexedSlices, Nones.
    """
    grads: List[Gradient] = [
        tf.convert_to_tensor(g) if sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
        for g in gradients]
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present or not process_set.included() or process_set.size() <= 1:
        return grads
    if op == Average:
        # The engine divides by the set size; the predivide factor moves part of the
        # division before the sum.
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    else:
        prescale = postscale = 1.0
    with tf.name_scope("DistributedGradientTape_Allreduce"):
        for k, bucket in enumerate(_buckets(present, variables, groups)):
            reduced = grouped_allreduce(
                [grads[i] for i in bucket], device_dense=device_dense,
                device_sparse=device_sparse, compression=compression, op=op,
                prescale_factor=prescale, postscale_factor=postscale, process_set=process_set,
                ignore_name_scope=use_generic_names,
                name=f"grad_{k}" if use_generic_names else None)
            for i, g in zip(bucket, reduced):
                grads[i] = g
    return grads


def divide_gradient(grad: Gradient, members: int) -> Gradient:
    """``grad / members``, keeping ``tf.IndexedSlices`` sparse: the scaling of a local
    gradient (``scale_local_gradients``)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / members, grad.indices, grad.dense_shape)
    return grad / members


class _DistributedTape:
    """What ``DistributedGradientTape`` adds to the class of the tape it wraps."""

    _aiak_options: Dict[str, Any]
    _local_sources: LocalGradients

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False):
        """The tape's gradients of ``target`` with respect to ``sources``, combined over
        the process set (those of registered local sources are only scaled, see
        ``scale_local_gradients``).  Same structure as ``sources``."""
        grads = super().gradient(target, sources, output_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = self._local_sources.combine(
            tf.nest.flatten(grads), flat_sources,
            lambda shared, where: allreduce_gradients(
                shared, where, use_generic_names=use_generic_names, **self._aiak_options),
            divide_gradient, self._aiak_options["process_set"].size)
        return tf.nest.pack_sequence_as(sources, flat_grads)

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient local to this rank (it is not combined)."""
        self._local_sources.add(source)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """``(local, global)`` lists of ``(source, gradient)`` pairs, in ``sources`` order:
        registered local sources, and all others."""
        flat_sources = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self.gradient(target, sources, output_gradients,
                                              use_generic_names))
        local, shared = [], []
        for s, g in zip(flat_sources, grads):
            (local if s in self._local_sources else shared).append((s, g))
        return local, shared


_tape_classes: Dict[type, type] = {}


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = '',
                            device_sparse: str = '',
                            compression: Type[Compressor] = Compression.none,
                            sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Groups = None,
                            process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` combines the gradients over the ranks.

    The result is a tape of a subclass of ``type(gradtape)`` with the same recording, so
    it can be made before or after the ``with`` block that records.  Options are those of
    :func:`allreduce_gradients`; ``num_groups`` is the deprecated form of ``groups``.
    ``register_local_source(var)`` keeps a variable's gradient local; such gradients are
    divided by the set size when ``scale_local_gradients`` is True.
    """
    groups = check_gradient_options(op, gradient_predivide_factor, num_groups, groups)
    base = type(gradtape)
    cls = _tape_classes.get(base)
    if cls is None:
        cls = _tape_classes[base] = type(base.__name__, (_DistributedTape, base), {})
    tape = object.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    # The wrapped tape shares the recording; pushing and popping it stays with whichever
    # object entered the ``with`` block, so the copy must not pop it again.
    tape._recording = False
    tape._aiak_options = dict(device_dense=device_dense, device_sparse=device_sparse,
                              compression=compression, sparse_as_dense=sparse_as_dense,
                              op=op, gradient_predivide_factor=gradient_predivide_factor,
                              groups=groups, process_set=process_set)
    tape._local_sources = LocalGradients(source_key, scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = '',
                                   device_sparse: str = '',
                                   compression: Type[Compressor] = Compression.none,
                                   sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Groups = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers=None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """:func:`DistributedGradientTape` whose ``local_layers`` (a Keras layer or a list of
    them) keep their trainable weights' gradients local."""
    if local_layers is None:
        local_layers = []
    elif hasattr(local_layers, "trainable_weights"):
        local_layers = [local_layers]
    elif not all(hasattr(layer, "trainable_weights") for layer in local_layers):
        raise ValueError(hs.LOCAL_LAYERS_TYPE)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
