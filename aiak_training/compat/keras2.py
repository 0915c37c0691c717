"""Keras 2 for Horovod scripts: what ``--horovod-compat`` adds to the ranks' environment.

Horovod 0.28.1 predates Keras 3, so its TensorFlow scripts use Keras 2's API through
``tf.keras`` (``opt.variables()``, ``compile(experimental_run_tf_function=False)``, ...).
TensorFlow >= 2.16 gives ``tf.keras`` = Keras 3 unless ``tf_keras`` is installed and
``TF_USE_LEGACY_KERAS=1`` is set.  So when the switch is on, ``tf_keras`` is installed and the
user has not set ``TF_USE_LEGACY_KERAS`` either way, the ranks get ``TF_USE_LEGACY_KERAS=1``,
and :data:`CHOSEN_ENV` so that rank 0's start-up line can say who chose it.  Setting
``TF_USE_LEGACY_KERAS=0`` keeps Keras 3.
"""
from __future__ import annotations

import importlib.util
from typing import Dict, Mapping

LEGACY_ENV = "TF_USE_LEGACY_KERAS"
#: Set for the ranks when --horovod-compat chose Keras 2 (read by
#: runtime/diagnostics/startup_line.py).
CHOSEN_ENV = "AIAK_COMPAT_KERAS2"


def tf_keras_installed() -> bool:
    """Whether Keras 2 (the ``tf_keras`` package) can be imported here."""
    try:
        return importlib.util.find_spec("tf_keras") is not None
    except (ImportError, ValueError):
        return False


def keras2_vars(environ: Mapping[str, str], set_vars: Mapping[str, str]) -> Dict[str, str]:
    """Variables that give a ``--horovod-compat`` job Keras 2: none when the user set
    ``TF_USE_LEGACY_KERAS`` (in the environment or with ``-x``) or ``tf_keras`` is missing."""
    if LEGACY_ENV in environ or LEGACY_ENV in set_vars or not tf_keras_installed():
        return {}
    return {LEGACY_ENV: "1", CHOSEN_ENV: "1"}
