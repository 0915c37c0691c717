"""What autotune changes, and how a setting is read from and applied to a running engine.

Knobs: the rows of the knob table (common/tuning) that autotune varies: the fusion threshold,
the cycle time, the response cache on/off and the global set's allreduce algorithm.  Their
variables, flags and candidate values come from the table.

The response cache cannot simply be flipped by the training thread: the engine thread reads
it while it classifies requests and feeds it as responses complete.  So the switch is handed
to the engine thread (the ``cache_switch`` atomic of the C++ core), which takes it at the top
of its next negotiation, before it classifies the requests it just dequeued.  Autotune asks for it at a step boundary before the
step's first tensor is queued, when nothing of the global set is pending on any rank, so every
rank classifies exactly the previous step's tensors under the old state and the next step's
under the new one.  Off empties the cache (its capacity, the size of the bit vectors every
rank exchanges, stays), so when it comes back on every rank starts from the same empty cache.
"""
import dataclasses
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from aiak_training.allreduce import ALGORITHMS, close_algorithm, create_algorithm, \
    resolve_algorithm
from aiak_training.common.config import Config
from aiak_training.common.topology import Topology
from aiak_training.common.tuning import (ALLREDUCE_ALGORITHM, CYCLE_TIME, FUSION_THRESHOLD,
                                         KNOBS, MB, RESPONSE_CACHE)
from aiak_training.runtime.autotune.options import AutotuneOptions

# Candidate values (the table's).
FUSION_MB = FUSION_THRESHOLD.candidates
CYCLE_MS = CYCLE_TIME.candidates

# The variables (a flag sets the first) that fix each knob autotune varies: a knob fixed by
# the user is left out of the search.
FIXING_VARS = {k.name: k.env for k in KNOBS if k.autotune}


@dataclasses.dataclass(frozen=True)
class Setting:
    fusion_threshold: int      # bytes
    cycle_time_ms: float
    algorithm: str             # one of allreduce.ALGORITHMS
    cache_enabled: bool

    def describe(self) -> str:
        """The setting as one readable phrase (rank 0's final line)."""
        return (f"fusion threshold {self.fusion_threshold / MB:g} MB, cycle time "
                f"{self.cycle_time_ms:g} ms, allreduce {self.algorithm}, response cache "
                f"{'on' if self.cache_enabled else 'off'}")

    def launcher_flags(self) -> str:
        """The ``aiakrun`` flags that fix this setting, so a later run needs no tuning."""
        mb, rest = divmod(self.fusion_threshold, MB)
        flags = [f"{FUSION_THRESHOLD.flag} {mb}" if not rest else "",
                 f"{CYCLE_TIME.flag} {self.cycle_time_ms:g}",
                 f"{ALLREDUCE_ALGORITHM.flag} {self.algorithm}"]
        if not self.cache_enabled:
            flags.append(f"{RESPONSE_CACHE.flag} 0")
        return " ".join(f for f in flags if f)

    def environment(self) -> str:
        """The same as variables, for jobs not started by aiakrun (mpirun, Ray, Spark)."""
        assignments = [f"{FUSION_THRESHOLD.variable}={self.fusion_threshold}",
                       f"{CYCLE_TIME.variable}={self.cycle_time_ms:g}",
                       f"{ALLREDUCE_ALGORITHM.variable}={self.algorithm}"]
        if not self.cache_enabled:
            assignments.append(f"{RESPONSE_CACHE.variable}=0")
        return " ".join(assignments)


def fixed_knobs(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Knobs the job fixed through their variable (aiakrun's flags set the same ones)."""
    env = os.environ if environ is None else environ
    return [knob for knob, names in FIXING_VARS.items()
            if any(env.get(name, "").strip() for name in names)]


def algorithm_name(algorithm: object) -> str:
    """The name of an allreduce algorithm object (flat is a plain function)."""
    return getattr(algorithm, "name", "flat")


def hierarchy_possible(config: Config, topology: Topology) -> bool:
    """Whether this job's layout allows a hierarchical allreduce (several nodes, some with
    more than one rank, over MPI): the rules of :func:`resolve_algorithm`."""
    trial = dataclasses.replace(config, allreduce_algo="hier_staged",
                                hierarchical_allreduce=None)
    return resolve_algorithm(trial, topology, is_global=True)[0] != "flat"


def tunable_algorithms(config: Config, topology: Topology, current: object,
                       environ: Optional[Mapping[str, str]] = None) -> Dict[str, object]:
    """Every algorithm the global set may switch to, by name, ``current`` included; empty
    when autotune is off, the algorithm is fixed, or the layout has no second level.

    Runs where the engine registers the global set, on every rank in the same order: the
    hierarchical algorithms are collective to build (hier_pipelined maps a shared window).
    """
    if not AutotuneOptions.from_env(environ).enabled or \
            "algorithm" in fixed_knobs(environ) or not hierarchy_possible(config, topology):
        return {}
    out = {algorithm_name(current): current}
    for name in ALGORITHMS:
        if name in out:
            continue
        algorithm = create_algorithm(name, topology)
        if algorithm_name(algorithm) != name:
            # hier_pipelined fell back to hier_staged (no shared memory): not a candidate.
            close_algorithm(algorithm)
            continue
        if getattr(algorithm, "close", None) is not None:
            topology.add_finalizer(algorithm.close)
        out[name] = algorithm
    return out


def current_setting(engine) -> Setting:
    """The setting in force on ``engine``."""
    cfg = engine.config
    cache = getattr(engine, "autotune_cache_enabled", cfg.cache_capacity > 0)
    return Setting(int(cfg.fusion_threshold), float(cfg.cycle_time_ms),
                   algorithm_name(engine.sets.get(0).algorithm), cache)


def _switch_cache(engine, on: bool) -> None:
    """Hand the cache switch to the engine thread (see the module docstring)."""
    engine.core.cache_switch = int(on)      # for the global set
    engine.autotune_cache_enabled = on


def apply_setting(engine, setting: Setting) -> None:
    """Put ``setting`` in force on this rank.  Every rank calls it at the same step boundary
    with none of the global set's allreduces in flight (see tuner.py)."""
    cfg = engine.config
    if cfg.fusion_threshold != setting.fusion_threshold:
        cfg.fusion_threshold = setting.fusion_threshold   # the engine's core hears of it
    if cfg.cycle_time_ms != setting.cycle_time_ms:
        cfg.cycle_time_ms = setting.cycle_time_ms
    if engine.algorithms and algorithm_name(engine.sets.get(0).algorithm) != setting.algorithm:
        engine.set_allreduce_algorithm(setting.algorithm)
    if current_setting(engine).cache_enabled != setting.cache_enabled:
        if setting.cache_enabled and cfg.cache_capacity <= 0:
            raise ValueError("the response cache cannot be switched on: "
                             f"{RESPONSE_CACHE.variable} is 0")
        _switch_cache(engine, setting.cache_enabled)


def search_axes(start: Setting, fixed: Sequence[str],
                algorithms: Sequence[str]) -> List[Tuple[str, Tuple]]:
    """(knob, candidate values) for each knob to tune, the starting value first so that the
    job's own setting is always measured."""
    axes: List[Tuple[str, Tuple]] = []
    if FUSION_THRESHOLD.name not in fixed:
        values = (start.fusion_threshold,) + tuple(mb * MB for mb in FUSION_MB)
        axes.append((FUSION_THRESHOLD.name, tuple(dict.fromkeys(values))))
    if CYCLE_TIME.name not in fixed:
        values = (start.cycle_time_ms,) + CYCLE_MS
        axes.append((CYCLE_TIME.name, tuple(dict.fromkeys(values))))
    if RESPONSE_CACHE.name not in fixed and start.cache_enabled:
        # Off is worth a sample: with few tensors per step, one negotiation round each may
        # cost less than the bit vectors and bookkeeping of the cache.
        axes.append((RESPONSE_CACHE.name, RESPONSE_CACHE.candidates))
    if len(algorithms) > 1:
        ordered = [start.algorithm] + [a for a in ALLREDUCE_ALGORITHM.candidates
                                       if a in algorithms]
        axes.append((ALLREDUCE_ALGORITHM.name, tuple(dict.fromkeys(ordered))))
    return [axis for axis in axes if len(axis[1]) > 1]
