"""Horovod's TensorFlow 2 scripts are Keras 2 scripts: ``--horovod-compat`` gives them Keras 2.

* Where ``tf_keras`` is installed and ``TF_USE_LEGACY_KERAS`` is not set, aiakrun sets it for
  the ranks, and rank 0's start-up line says so: a script in Horovod's Keras 2 idioms
  (tests/scripts/horovod_keras2_idioms.py) trains at 2 ranks to the same weights on both.
* Where ``tf_keras`` is missing the same script fails under Keras 3, and the output ends with
  one line saying how to install Keras 2 (with ``TF_USE_LEGACY_KERAS=0`` set, how to enable it).
* The decisions themselves, without a launch.
"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from aiak_training.compat import keras_hint
from aiak_training.compat.keras2 import CHOSEN_ENV, LEGACY_ENV, keras2_vars
from launch import REPO, clean_env

SCRIPT = os.path.join(REPO, "tests", "scripts", "horovod_keras2_idioms.py")
needs_tf = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("tf_keras") is None,
    reason="needs TensorFlow and tf_keras (pip install -e '.[tensorflow]' and "
           "pip install --no-deps tf-keras)")


def _aiakrun(np_: int, extra_path: str = "", **env: str) -> subprocess.CompletedProcess:
    environ = clean_env(TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1")
    environ.pop(LEGACY_ENV, None)  # each test decides
    environ.update(env)
    if extra_path:
        environ["PYTHONPATH"] = os.pathsep.join([extra_path, environ["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-m", "aiak_training.runner.launch",
                           "--horovod-compat", "-np", str(np_), sys.executable, SCRIPT],
                          env=environ, capture_output=True, text=True, timeout=300, cwd=REPO)


@needs_tf
def test_horovod_keras2_script_trains_with_tf_keras_chosen_by_the_switch():
    proc = _aiakrun(2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = sorted(re.findall(r"rank (\d) keras (\w+) weights (.*)", proc.stdout))
    assert [(r, k) for r, k, _ in lines] == [("0", "tf_keras"), ("1", "tf_keras")], proc.stdout
    assert lines[0][2] == lines[1][2]  # broadcast and averaged: the same weights
    assert "tf.keras is Keras 2 (tf_keras): TF_USE_LEGACY_KERAS=1 set by --horovod-compat" \
        in proc.stderr, proc.stderr[-3000:]


@needs_tf
def test_without_tf_keras_the_error_says_how_to_install_it(tmp_path):
    # sitecustomize makes tf_keras unimportable for aiakrun and its ranks alike.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['tf_keras'] = None\n")
    proc = _aiakrun(1, extra_path=str(tmp_path))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    import tensorflow as tf  # noqa: F401 - its version is in the hint
    minor = ".".join(tf.__version__.split(".")[:2])
    assert last.startswith(keras_hint.HINT_PREFIX), proc.stderr[-3000:]
    assert f"pip install --no-deps tf-keras~={minor}.0" in last
    assert "experimental_run_tf_function" in proc.stderr  # the error itself is still shown
    assert "tf.keras is Keras 2" not in proc.stderr  # the start-up line: Keras 3 stays


def test_hint_says_how_to_enable_an_installed_tf_keras():
    line = keras_hint.hint("2.21.0", installed=True)
    assert line.startswith(keras_hint.HINT_PREFIX)
    assert "tf_keras is installed: set TF_USE_LEGACY_KERAS=1" in line
    assert "\n" not in line  # one line


def test_switch_sets_keras2_only_when_wanted_and_installed(monkeypatch):
    monkeypatch.setattr("aiak_training.compat.keras2.tf_keras_installed", lambda: True)
    assert keras2_vars({}, {}) == {LEGACY_ENV: "1", CHOSEN_ENV: "1"}
    assert keras2_vars({LEGACY_ENV: "0"}, {}) == {}       # the user's choice stands
    assert keras2_vars({}, {LEGACY_ENV: "1"}) == {}       # given with -x
    monkeypatch.setattr("aiak_training.compat.keras2.tf_keras_installed", lambda: False)
    assert keras2_vars({}, {}) == {}


@pytest.mark.parametrize("text, expected", [
    # tf.function: the failing source line is in the message.
    ("TypeError: in user code:\n    hvd.broadcast_variables(opt.variables(), root_rank=0)\n\n"
     "    TypeError: 'list' object is not callable", True),
    # Eager: the failing line comes from the traceback.
    ("TypeError: 'list' object is not callable\n    opt.variables()", True),
    ("TypeError: Trainer.compile() got an unexpected keyword argument "
     "'experimental_run_tf_function'", True),
    ("AttributeError: 'SGD' object has no attribute 'lr'", True),
    ("TypeError: 'list' object is not callable\n    handlers()", False),
    ("ValueError: shapes (3,) and (4,) not aligned", False),
])
def test_keras2_idiom_errors_are_recognised(text, expected):
    assert keras_hint.is_keras2_idiom_error(text) is expected
