"""Which gradients travel together, from DistributedOptimizer's ``groups`` option.

Shared by backends whose gradient reduction is written here (the TensorFlow backend uses
``aiak_training.tensorflow``'s own).
"""
from typing import Any, List, Optional, Sequence, Union

Groups = Optional[Union[int, List[List[Any]]]]


def buckets(present: List[int], variables: Sequence[Any], groups: Groups) -> List[List[int]]:
    """Positions of ``present`` (indices into ``variables``) split into operations.

    ``groups`` None: one operation.  An int: that many operations over consecutive
    gradients, as even as possible (earlier ones take the remainder).  Lists of variables:
    each list's gradients together, and every gradient in no list on its own.
    """
    if groups is None:
        return [present]
    if isinstance(groups, list):
        where = {id(variables[i]): i for i in present}
        out = []
        for group in groups:
            bucket = sorted(where.pop(id(v)) for v in group if id(v) in where)
            if bucket:
                out.append(bucket)
        return out + [[i] for i in present if id(variables[i]) in where]
    base, extra = divmod(len(present), groups)
    out, start = [], 0
    for k in range(groups):
        end = start + base + (1 if k < extra else 0)
        if end > start:
            out.append(present[start:end])
        start = end
    return out
