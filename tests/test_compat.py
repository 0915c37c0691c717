"""The Horovod compatibility switch: shim location, never shadowing a real Horovod, aliasing."""
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

from aiak_training.compat import RealHorovodError, compat_pythonpath, find_real_horovod, shim_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = shim_dir()


def _env(pythonpath, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIAK_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env.update(extra)
    return env


def _python(code, pythonpath, cwd=None):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(pythonpath),
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120, cwd=cwd or REPO)


@pytest.fixture
def real_horovod(tmp_path):
    """A stand-in for an installed Horovod: a regular ``horovod`` package in a site dir."""
    site = tmp_path / "site"
    (site / "horovod").mkdir(parents=True)
    (site / "horovod" / "__init__.py").write_text("REAL = True\n")
    return str(site)


def test_shim_layout():
    assert SHIM == os.path.join(REPO, "aiak_training", "compat", "horovod_shim")
    for rel in ("__init__.py", "torch/__init__.py", "torch/mpi_ops.py", "torch/optimizer.py",
                "tensorflow/__init__.py", "tensorflow/keras/__init__.py",
                "common/exceptions.py"):
        assert os.path.isfile(os.path.join(SHIM, "horovod", rel)), rel
    # Not a package itself, so it is never importable as aiak_training.compat.horovod_shim.
    assert not os.path.exists(os.path.join(SHIM, "__init__.py"))


def test_pythonpath_command_prints_shim_dir():
    proc = subprocess.run([sys.executable, "-m", "aiak_training.compat", "--pythonpath"],
                          env=_env([REPO]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=60, cwd=REPO)
    assert (proc.returncode, proc.stdout) == (0, SHIM + "\n")


def test_pythonpath_command_refuses_with_real_horovod(real_horovod):
    proc = subprocess.run([sys.executable, "-m", "aiak_training.compat", "--pythonpath"],
                          env=_env([REPO, real_horovod]), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1 and proc.stdout == ""
    assert os.path.join(real_horovod, "horovod", "__init__.py") in proc.stderr
    assert "refusing to shadow it" in proc.stderr


def test_compat_pythonpath_logic(real_horovod, tmp_path):
    assert compat_pythonpath("/a:/b") == os.pathsep.join([SHIM, "/a", "/b"])
    assert compat_pythonpath(None) == SHIM
    assert compat_pythonpath(os.pathsep.join([SHIM, "/a"])) == os.pathsep.join([SHIM, "/a"])
    with pytest.raises(RealHorovodError) as err:
        compat_pythonpath(os.pathsep.join(["/a", real_horovod]))
    assert os.path.join(real_horovod, "horovod", "__init__.py") in str(err.value)
    assert SHIM in str(err.value)
    # A directory called horovod without __init__.py (e.g. a checkout's parent) is no install.
    (tmp_path / "ns" / "horovod").mkdir(parents=True)
    assert find_real_horovod([str(tmp_path / "ns")]) is None
    assert find_real_horovod([SHIM]) is None


def test_shim_refuses_to_load_over_real_horovod(real_horovod):
    proc = _python("import horovod", [SHIM, REPO, real_horovod])
    assert proc.returncode == 1
    assert "ImportError: the aiak-training Horovod compatibility shim" in proc.stderr
    assert os.path.join(SHIM, "horovod", "__init__.py") in proc.stderr
    assert os.path.join(real_horovod, "horovod", "__init__.py") in proc.stderr


def test_shim_aliases_exceptions_and_tensorflow_reports_missing_frontend():
    proc = _python("""
        import horovod, horovod.common.exceptions as exc
        import aiak_training.common.exceptions as ours
        assert exc is ours and exc.HorovodInternalError is ours.HorovodInternalError
        print(horovod.__version__)
        try:
            import horovod.tensorflow
        except ImportError as e:
            print("tf:", type(e).__name__)
        else:
            print("tf: imported")
        """, [SHIM, REPO])
    assert proc.returncode == 0, proc.stderr
    tf_line = "tf: imported" if _tf_frontend_usable() else "tf: ImportError"
    assert proc.stdout.splitlines() == ["0.28.1", tf_line]


def _tf_frontend_usable():
    proc = _python("import aiak_training.tensorflow as t; assert t.__file__", [REPO])
    return proc.returncode == 0


def test_horovod_torch_resolves_to_aiak_training_torch():
    proc = _python("""
        import horovod.torch as hvd
        import horovod.torch.mpi_ops as mpi_ops
        from horovod.torch import DistributedOptimizer, allreduce
        from horovod.torch.optimizer import DistributedOptimizer as DO2
        import aiak_training.torch as ours
        assert hvd.__name__ == "horovod.torch", hvd.__name__
        assert allreduce is ours.allreduce and hvd.rank is ours.rank
        assert DistributedOptimizer is ours.DistributedOptimizer is DO2
        assert hvd.mpi_ops is mpi_ops
        assert mpi_ops is __import__("sys").modules.get("aiak_training.torch.mpi_ops", ours)
        assert "allreduce" in dir(hvd)
        ns = {}
        exec("from horovod.torch import *", ns)
        assert ns["allreduce"] is ours.allreduce
        try:
            hvd.no_such_thing
        except AttributeError as e:
            print(e)
        """, [SHIM, REPO])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("module 'horovod.torch' (aiak-training's aiak_training.torch) "
                                   "has no attribute 'no_such_thing'")


def _aiakrun(argv, pythonpath, **extra):
    return subprocess.run([sys.executable, "-m", "aiak_training.runner.launch", *argv],
                          env=_env(pythonpath, **extra), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=120, cwd=REPO)


PROBE = ("import horovod, os, sys; sys.stdout.write('%s %s %s\\n' % (horovod.__version__, "
         "horovod.__file__, os.environ.get('AIAK_HOROVOD_COMPAT')))")


@pytest.mark.parametrize("switch", ["flag", "env"])
def test_aiakrun_horovod_compat_switch(switch):
    argv = (["--horovod-compat"] if switch == "flag" else []) + [
        "-np", "1", sys.executable, "-c", PROBE]
    extra = {"AIAK_HOROVOD_COMPAT": "1"} if switch == "env" else {}
    proc = _aiakrun(argv, [REPO], **extra)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-3:] == ["0.28.1", os.path.join(SHIM, "horovod", "__init__.py"),
                                        "1"]


def test_aiakrun_without_switch_has_no_horovod():
    proc = _aiakrun(["-np", "1", sys.executable, "-c", "import horovod"], [REPO])
    assert proc.returncode == 1
    assert "ModuleNotFoundError: No module named 'horovod'" in proc.stderr


def test_aiakrun_horovod_compat_refuses_real_horovod(real_horovod):
    proc = _aiakrun(["--horovod-compat", "-np", "1", "true"], [REPO, real_horovod])
    assert proc.returncode == 2
    assert proc.stderr.startswith("aiakrun: error: --horovod-compat: a real Horovod is "
                                  f"installed at {os.path.join(real_horovod, 'horovod')}")


def test_unmodified_horovod_script_runs_on_two_virtual_nodes():
    # End to end: `import horovod.torch as hvd` under aiakrun --horovod-compat, on 2 virtual
    # nodes x 1 rank, so the engine must see local_size 1 and cross_size 2.
    script = ("import sys, torch, horovod.torch as hvd\n"
              "hvd.init()\n"
              "s = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)\n"
              "sys.stdout.write('r=%d size=%d local=%d/%d cross=%d/%d sum=%g\\n' % (hvd.rank(), "
              "hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), "
              "hvd.cross_size(), s.item()))\n"
              "hvd.shutdown()\n")
    proc = _aiakrun(["--horovod-compat", "--virtual-hosts", "-H", "a:1,b:1", "-np", "2",
                     sys.executable, "-c", script], [REPO])
    assert proc.returncode == 0, proc.stderr
    lines = sorted(re.findall(r"r=\d .*", proc.stdout))  # any launcher's rank label is skipped
    assert lines == ["r=0 size=2 local=0/1 cross=0/2 sum=3", "r=1 size=2 local=0/1 cross=1/2 sum=3"]


_needs_tf = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="TensorFlow and Keras are not installed (pip install -e '.[tensorflow]')")


@_needs_tf
def test_horovod_tensorflow_resolves_to_aiak_training_tensorflow():
    proc = _python("""
        import horovod.tensorflow as hvd
        import horovod.tensorflow.mpi_ops as mpi_ops
        from horovod.tensorflow import DistributedGradientTape, allreduce
        from horovod.tensorflow.compression import Compression
        from horovod.tensorflow.functions import broadcast_variables
        from horovod.tensorflow.sync_batch_norm import SyncBatchNormalization
        import aiak_training.tensorflow as ours
        assert hvd.__name__ == "horovod.tensorflow", hvd.__name__
        assert allreduce is ours.allreduce and hvd.rank is ours.rank
        assert DistributedGradientTape is ours.DistributedGradientTape
        assert Compression is ours.Compression and broadcast_variables is ours.broadcast_variables
        assert SyncBatchNormalization is ours.SyncBatchNormalization
        assert mpi_ops is ours.mpi_ops and hvd.mpi_ops is mpi_ops
        assert hvd.HorovodInternalError is __import__("horovod.common.exceptions").common \\
            .exceptions.HorovodInternalError
        print("ok")
        """, [SHIM, REPO])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


@_needs_tf
def test_unmodified_horovod_tensorflow_script_runs():
    # `import horovod.tensorflow as hvd` under aiakrun --horovod-compat at 2 ranks: eager and
    # tf.function collectives, and a DistributedGradientTape step.
    script = textwrap.dedent("""
        import sys
        import tensorflow as tf
        import horovod.tensorflow as hvd
        hvd.init()
        x = tf.constant([float(hvd.rank() + 1)])
        eager = hvd.allreduce(x, op=hvd.Sum)
        graph = tf.function(lambda t: hvd.allgather(t))(x)
        v = tf.Variable([1.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * x)
        grad = hvd.DistributedGradientTape(tape).gradient(loss, [v])[0]
        sys.stdout.write("r=%d sum=%g gathered=%s grad=%g\\n" % (
            hvd.rank(), eager.numpy()[0], graph.numpy().tolist(), grad.numpy()[0]))
        hvd.shutdown()
        """)
    proc = _aiakrun(["--horovod-compat", "-np", "2", sys.executable, "-c", script], [REPO],
                    TF_CPP_MIN_LOG_LEVEL="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(re.findall(r"r=\d .*", proc.stdout))
    assert lines == ["r=0 sum=3 gathered=[1.0, 2.0] grad=1.5",
                     "r=1 sum=3 gathered=[1.0, 2.0] grad=1.5"], proc.stdout


@_needs_tf
def test_unmodified_horovod_keras_scripts_run():
    # `import horovod.tensorflow.keras as hvd` (and horovod.keras) under aiakrun
    # --horovod-compat at 2 ranks: the names resolve to aiak_training's Keras frontend, and
    # a model.fit with Horovod's optimizer and callbacks ends with the same weights on both.
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import keras
        import horovod.tensorflow.keras as hvd
        import horovod.keras
        from horovod.tensorflow.keras.callbacks import BroadcastGlobalVariablesCallback
        import aiak_training.keras as ours
        assert hvd.__name__ == "horovod.tensorflow.keras", hvd.__name__
        assert hvd.DistributedOptimizer is ours.DistributedOptimizer
        assert horovod.keras.DistributedOptimizer is ours.DistributedOptimizer
        assert BroadcastGlobalVariablesCallback is ours.callbacks.BroadcastGlobalVariablesCallback
        assert horovod.keras.callbacks.MetricAverageCallback is \\
            ours.callbacks.MetricAverageCallback
        hvd.init()
        rng = np.random.default_rng(hvd.rank())
        x = rng.normal(size=(16, 3)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="mse")
        model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                             hvd.callbacks.MetricAverageCallback()])
        w = np.concatenate([keras.ops.convert_to_numpy(v).ravel() for v in model.weights])
        sys.stdout.write("r=%d weights=%s\\n" % (hvd.rank(), w.round(6).tolist()))
        """)
    # A Keras 3 script: TF_USE_LEGACY_KERAS=0 keeps Keras 3 where tf_keras is installed
    # (--horovod-compat would otherwise give tf.keras = Keras 2, see test_horovod_keras2.py).
    proc = _aiakrun(["--horovod-compat", "-np", "2", sys.executable, "-c", script], [REPO],
                    TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
                    TF_USE_LEGACY_KERAS="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(re.findall(r"r=\d weights=.*", proc.stdout))
    assert len(lines) == 2 and lines[0][4:] == lines[1][4:], proc.stdout
