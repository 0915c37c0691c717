"""Horovod's autotune (``HOROVOD_AUTOTUNE=1``, ``aiakrun --autotune``), scored on step time.

* options.py: the ``HOROVOD_AUTOTUNE*`` variables;
* knobs.py: what is tuned, which knobs the user fixed, reading and applying a setting;
* search.py: the search (one knob at a time, then a confirmation round);
* tuner.py: steps, samples and the switch every rank makes at the same step boundary;
* csvlog.py: the log in Horovod's CSV format.

:func:`start` is called by ``init`` once the engine runs.  docs/choosing-a-configuration.md
describes the whole.
"""
from typing import Any, Dict

from aiak_training.runtime.autotune.knobs import current_setting, fixed_knobs, search_axes
from aiak_training.runtime.autotune.options import AutotuneOptions
from aiak_training.runtime.autotune.tuner import Autotuner, say


def start(engine) -> None:
    """Attach an autotuner to ``engine`` when ``HOROVOD_AUTOTUNE`` asks for one.  Every rank
    decides the same way, from the same variables and topology."""
    options = AutotuneOptions.from_env()
    if not options.enabled:
        return
    fixed = fixed_knobs()
    begin = current_setting(engine)
    axes = search_axes(begin, fixed, list(engine.algorithms))
    if not axes:
        if engine.rank_in_set(0) == 0:
            say(f"nothing to tune: the fusion threshold, cycle time and response cache "
                 f"are fixed ({', '.join(fixed) or 'none'}) and the allreduce algorithm "
                 f"cannot change here; keeping {begin.describe()}.")
        return
    engine.autotune = Autotuner(engine, options, begin, axes)


def setting_in_force() -> Dict[str, Any]:
    """The knobs in force on this rank now (fusion threshold in bytes, cycle time in ms,
    allreduce algorithm, response cache on/off): what a job or a test logs per step."""
    from aiak_training.runtime import current
    setting = current_setting(current.engine())
    return {"fusion_threshold": setting.fusion_threshold,
            "cycle_time_ms": setting.cycle_time_ms, "algorithm": setting.algorithm,
            "cache_enabled": setting.cache_enabled}


def tuning() -> bool:
    """Whether autotune is still tuning on this rank."""
    from aiak_training.runtime import current
    return current.engine().autotune is not None


__all__ = ["AutotuneOptions", "Autotuner", "start", "setting_in_force", "tuning"]
