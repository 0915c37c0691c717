"""Autotune's settings, from Horovod's ``HOROVOD_AUTOTUNE*`` variables (same names, same
defaults as Horovod 0.28.1; ``aiakrun --autotune*`` sets them)."""
from dataclasses import dataclass
from typing import Mapping, Optional

from aiak_training.common.env import env_bool, env_float, env_int, env_str


@dataclass(frozen=True)
class AutotuneOptions:
    enabled: bool = False                 # HOROVOD_AUTOTUNE
    log_file: Optional[str] = None        # HOROVOD_AUTOTUNE_LOG
    warmup_samples: int = 3               # HOROVOD_AUTOTUNE_WARMUP_SAMPLES
    steps_per_sample: int = 10            # HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE
    max_samples: int = 20                 # HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES
    # HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE: read and checked so that Horovod job scripts
    # run unchanged, but the search here is not a Gaussian process (docs/choosing-a-
    # configuration.md says why), so it has no effect.
    gaussian_process_noise: float = 0.8

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "AutotuneOptions":
        """Read the variables; a malformed one raises ``ValueError`` naming it."""
        return cls(
            enabled=env_bool("HOROVOD_AUTOTUNE", environ=environ),
            log_file=env_str("HOROVOD_AUTOTUNE_LOG", environ=environ),
            warmup_samples=env_int("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", cls.warmup_samples,
                                   minimum=0, environ=environ),
            steps_per_sample=env_int("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
                                     cls.steps_per_sample, minimum=1, environ=environ),
            max_samples=env_int("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", cls.max_samples,
                                minimum=1, environ=environ),
            gaussian_process_noise=env_float("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
                                             cls.gaussian_process_noise, minimum=0.0,
                                             environ=environ),
        )
