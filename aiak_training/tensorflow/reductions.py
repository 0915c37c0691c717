"""The public reductions of ``horovod.tensorflow``: allreduce and reducescatter with
compression, and allreduce of ``tf.IndexedSlices``.

Sparse gradients (``tf.IndexedSlices``, e.g. of an embedding lookup) are not reduced
element-wise: their values and indices are gathered from every member instead, which
represents the sum (duplicate indices add up when the slices are applied); for Average the
gathered values are divided by the set size.
"""
from typing import List, Optional, Sequence, Type, Union

import tensorflow as tf

from aiak_training.common.horovod_strings import (IS_ADASUM_UNSUPPORTED, IS_OPS_SUPPORTED,
                                                  IS_SCALING_UNSUPPORTED)
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.tensorflow import mpi_ops
from aiak_training.tensorflow.compression import Compression, Compressor
from aiak_training.tensorflow.mpi_ops import (Adasum, Average, Sum,
                                              handle_average_backwards_compatibility)

Dense = Union[tf.Tensor, tf.Variable]


def _check_sparse(op: int, prescale_factor: float, postscale_factor: float) -> None:
    if op == Adasum:
        raise NotImplementedError(IS_ADASUM_UNSUPPORTED)
    if op not in (Sum, Average):
        raise NotImplementedError(IS_OPS_SUPPORTED)
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError(IS_SCALING_UNSUPPORTED)


def _sparse_reduce(slices: List[tf.IndexedSlices], op: int, process_set: ProcessSet,
                   ignore_name_scope: bool) -> List[tf.IndexedSlices]:
    """Every member's slices, gathered; values divided by the set size for Average."""
    values = mpi_ops.grouped_allgather([s.values for s in slices],
                                       ignore_name_scope=ignore_name_scope,
                                       process_set=process_set)
    indices = mpi_ops.grouped_allgather([s.indices for s in slices],
                                        ignore_name_scope=ignore_name_scope,
                                        process_set=process_set)
    members = process_set.size()
    if op == Average:
        values = [v / tf.cast(members, v.dtype) for v in values]
    return [tf.IndexedSlices(v, i, dense_shape=s.dense_shape)
            for v, i, s in zip(values, indices, slices)]


def allreduce(tensor: Union[Dense, tf.IndexedSlices], average: Optional[bool] = None,
              device_dense: str = '', device_sparse: str = '',
              compression: Type[Compressor] = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: Optional[str] = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Union[tf.Tensor, tf.IndexedSlices]:
    """Reduce ``tensor`` over ``process_set`` (all ranks by default) with ``op``.

    Arguments:
        tensor: a tensor, variable or ``tf.IndexedSlices``; the same shape on every member.
        average: deprecated; True means ``op=Average``, False ``op=Sum``.
        device_dense, device_sparse: the device for the surrounding TensorFlow ops
            (dense and sparse inputs); the data itself moves through host memory.
        compression: how the tensor travels (``Compression.none`` or ``.fp16``).
        op: Average (the default), Sum, Min, Max or Product; IndexedSlices take Sum or
            Average only.
        prescale_factor, postscale_factor: multiply before and after reducing (dense only).
        name: the operation's name (see ``mpi_ops`` for the rules).
        process_set: the ranks taking part.
        ignore_name_scope: leave the name scope out of a graph op's name.

    Returns:
        A tensor of ``tensor``'s shape and type (IndexedSlices stay IndexedSlices).
        Differentiable: the gradient is reduced with the same op and scale factors.
    """
    op = handle_average_backwards_compatibility(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        with tf.device(device_sparse):
            return _sparse_reduce([tensor], op, process_set, ignore_name_scope)[0]
    with tf.device(device_dense):
        wire, ctx = compression.compress(tf.convert_to_tensor(tensor))
        reduced = mpi_ops._allreduce(wire, name=name, op=op, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor,
                                     ignore_name_scope=ignore_name_scope,
                                     process_set=process_set)
        return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors: Sequence[Union[Dense, tf.IndexedSlices]],
                      average: Optional[bool] = None, device_dense: str = '',
                      device_sparse: str = '',
                      compression: Type[Compressor] = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: Optional[str] = None
                      ) -> List[Union[tf.Tensor, tf.IndexedSlices]]:
    """:func:`allreduce` of several tensors as one operation, matched across ranks by list
    position; returns a list in input order.

    The dense tensors travel together (one submission, which the engine fuses); the
    IndexedSlices among them are gathered together.
    """
    op = handle_average_backwards_compatibility(op, average)
    if not tensors:  # Horovod hands an empty sequence back as it came
        return tensors
    results: List = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
        with tf.device(device_sparse):
            reduced = _sparse_reduce([tensors[i] for i in sparse], op, process_set,
                                     ignore_name_scope)
        for i, r in zip(sparse, reduced):
            results[i] = r
    if dense:
        with tf.device(device_dense):
            encoded = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
            reduced = mpi_ops._grouped_allreduce(
                [wire for wire, _ in encoded], name=name, op=op,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                ignore_name_scope=ignore_name_scope, process_set=process_set)
            for i, r, (_, ctx) in zip(dense, reduced, encoded):
                results[i] = compression.decompress(r, ctx)
    return results


def reducescatter(tensor: Dense, device_dense: str = '',
                  compression: Type[Compressor] = Compression.none, op: int = Average,
                  name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over the members with ``op`` (Average by default) and keep this
    rank's block of rows: blocks follow rank order along dimension 0, and when the rows do
    not divide evenly the lowest ranks get one more row each.

    Differentiable: the gradient is the allgather of the incoming gradients, times the set
    size for Sum and times both scale factors.
    """
    with tf.device(device_dense):
        wire, ctx = compression.compress(tf.convert_to_tensor(tensor))
        reduced = mpi_ops._reducescatter(wire, name=name, op=op,
                                         ignore_name_scope=ignore_name_scope,
                                         process_set=process_set,
                                         prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor)
        return compression.decompress(reduced, ctx)


def grouped_reducescatter(tensors: Sequence[Dense], device_dense: str = '',
                          compression: Type[Compressor] = Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[tf.Tensor]:
    """:func:`reducescatter` of several tensors as one operation; a list in input order."""
    if not tensors:
        return tensors
    with tf.device(device_dense):
        encoded = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
        reduced = mpi_ops._grouped_reducescatter(
            [wire for wire, _ in encoded], op=op, process_set=process_set,
            prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, encoded)]
