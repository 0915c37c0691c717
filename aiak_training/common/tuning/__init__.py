"""The knobs of a configuration, in one table (:mod:`.table`).

Every knob a job can be tuned with is a row of :data:`KNOBS`: its name, the environment
variables that set it, its ``aiakrun`` flag, the values autotune tries, how it takes effect and
whether autotune and the advisor vary it.  ``common/config.Config`` reads the variables named
here, autotune (``runtime/autotune``) its candidates and the flags it prints, the advisor
(``advisor/model.py``) its rows' flags, and aiakrun (``runner/cli``) maps the flags to the
variables through it.  Nothing else lists these names; tests/test_knob_table.py checks that.
"""
from aiak_training.common.tuning.table import (ALGORITHM_ALIASES, ALGORITHM_CHOICES, ALGORITHMS,
                                                ALLREDUCE_ALGORITHM, AT_START, AT_STEP,
                                                CYCLE_TIME, DGC, FUSED_OPTIMIZER,
                                                FUSION_THRESHOLD, HIERARCHICAL_ALLREDUCE_VARIABLE,
                                                IN_SCRIPT, KNOBS, MB, OVERLAP_UPDATE,
                                                RESPONSE_CACHE, Knob, knob)

__all__ = ["ALGORITHM_ALIASES", "ALGORITHM_CHOICES", "ALGORITHMS", "ALLREDUCE_ALGORITHM",
           "AT_START", "AT_STEP", "CYCLE_TIME", "DGC", "FUSED_OPTIMIZER", "FUSION_THRESHOLD",
           "HIERARCHICAL_ALLREDUCE_VARIABLE", "IN_SCRIPT", "KNOBS", "MB", "OVERLAP_UPDATE",
           "RESPONSE_CACHE", "Knob", "knob"]
