"""The ``groups``/``num_groups`` options of the TensorFlow and Keras distributed optimizers."""
import warnings
from typing import Any

from aiak_training.common import horovod_strings as hs


def fold_num_groups(num_groups: int, groups: Any) -> Any:
    """``groups`` with the deprecated ``num_groups`` folded in (it applies when ``groups`` is
    not given), checked: a positive count or a list of variable lists."""
    if num_groups != 0:
        warnings.warn(hs.NUM_GROUPS_DEPRECATED, DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError(hs.GROUPS_TYPE_TF)
    return groups
