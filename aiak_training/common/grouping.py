"""Which gradients travel together: the ``groups`` option of every frontend's distributed
optimizer (torch, TensorFlow, Keras), written once.

A frontend numbers its gradients (``present``: the positions that have one, in the order
it reduces them) and says how a position and a listed variable are identified; this module
splits the positions into operations.  It never looks at a tensor.
"""
import warnings
from typing import Any, Callable, Hashable, List, Optional, Sequence, TypeVar, Union

from aiak_training.common import horovod_strings as hs

T = TypeVar("T")

#: None (one operation), a number of operations, or lists of variables reduced together.
Groups = Optional[Union[int, List[List[Any]]]]


def even_chunks(items: Sequence[T], n: int) -> List[List[T]]:
    """``items`` cut into ``n`` consecutive runs, as even as possible: the first
    ``len(items) % n`` are one longer (runs are empty when ``n`` exceeds the items)."""
    base, longer = divmod(len(items), n)
    chunks, start = [], 0
    for i in range(n):
        stop = start + base + (i < longer)
        chunks.append(list(items[start:stop]))
        start = stop
    return chunks


def group_positions(present: List[int], groups: Groups,
                    position_key: Callable[[int], Hashable],
                    member_key: Callable[[Any], Hashable]) -> List[List[int]]:
    """``present`` split into the operations ``groups`` asks for, each a list of positions.

    ``groups`` None: one operation of all.  An int: that many operations over consecutive
    positions (:func:`even_chunks`; empty ones are left out).  Lists of variables: each
    list's positions together, in position order (a variable without a gradient is left
    out, one listed twice counts in its first list), then every position in no list on its
    own.  ``position_key(i)`` and ``member_key(v)`` must agree for the variable at ``i``.
    """
    if groups is None:
        return [present]
    if isinstance(groups, list):
        where = {position_key(i): i for i in present}
        out = []
        for group in groups:
            bucket = sorted(where.pop(member_key(v)) for v in group if member_key(v) in where)
            if bucket:
                out.append(bucket)
        return out + [[i] for i in present if position_key(i) in where]
    return [chunk for chunk in even_chunks(present, groups) if chunk]


class LocalGradients:
    """The variables whose gradients stay on this rank (``register_local_var``,
    ``register_local_source``, the local layers of the ``Partial*`` wrappers), and how a
    step's gradients are combined around them: the others are reduced over the process set,
    the local ones kept, and divided by its size when ``scale`` is set.

    One rule for the TensorFlow tape and both Keras optimizers; the frontend brings the
    reduction, the division and ``key``, which tells variables apart (TensorFlow's
    ``ref()``, else identity)."""

    def __init__(self, key: Callable[[Any], Hashable], scale: bool):
        self.key = key
        self.scale = scale
        self._keys: set = set()

    def add(self, variable: Any) -> None:
        """Keep ``variable``'s gradient on this rank from now on."""
        self._keys.add(self.key(variable))

    def __contains__(self, variable: Any) -> bool:
        return self.key(variable) in self._keys

    def __bool__(self) -> bool:
        return bool(self._keys)

    def combine(self, grads: Sequence[Any], variables: Sequence[Any],
                reduce: Callable[[List[Any], List[Any]], Sequence[Any]],
                divide: Callable[[Any, int], Any], members: Callable[[], int]) -> List[Any]:
        """``grads`` (one per variable, None allowed) with the shared ones replaced by
        ``reduce(shared_grads, shared_variables)`` and, with ``scale``, each local one that
        is not None by ``divide(grad, members())``."""
        shared = [i for i, v in enumerate(variables) if v not in self]
        reduced = reduce([grads[i] for i in shared], [variables[i] for i in shared])
        out = list(grads)
        for i, grad in zip(shared, reduced):
            out[i] = grad
        if self.scale and self._keys:
            size = members()
            for i, variable in enumerate(variables):
                if out[i] is not None and variable in self:
                    out[i] = divide(out[i], size)
        return out


def fold_num_groups(num_groups: int, groups: Any) -> Any:
    """``groups`` with the deprecated ``num_groups`` of the TensorFlow and Keras optimizers
    folded in (it applies when ``groups`` is not given), checked: a positive count or a list
    of variable lists."""
    if num_groups != 0:
        warnings.warn(hs.NUM_GROUPS_DEPRECATED, DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError(hs.GROUPS_TYPE_TF)
    return groups
