"""The Ray/Spark front ends' shared pieces, without Ray or Spark: rank layout, environment,
pickling checks, the ImportErrors that name the extras, and the horovod.ray/horovod.spark
compatibility aliases."""
import os
import subprocess
import sys
import threading

import pytest

from aiak_training.runner.modes import scheduler_jobs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_contiguous_order_groups_hosts_in_first_appearance_order():
    assert scheduler_jobs.contiguous_order(["b", "a", "b", "c", "a"]) == [0, 2, 1, 4, 3]
    assert scheduler_jobs.contiguous_order(["x", "x", "y"]) == [0, 1, 2]


def test_rank_envs_carry_identity_rendezvous_and_user_overrides():
    envs = scheduler_jobs.rank_envs(["n1", "n1", "n2"], "10.0.0.1", 4242, timeout_s=12,
                                 nics=["eth1", "eth0"], extra={"X": 1, "HOROVOD_GLOO_IFACE": "ib0"})
    # n1:2 n2:1, numbered by hand: (rank, local rank, local size, cross rank, cross size).
    assert [(e["HOROVOD_RANK"], e["HOROVOD_LOCAL_RANK"], e["HOROVOD_LOCAL_SIZE"],
             e["HOROVOD_CROSS_RANK"], e["HOROVOD_CROSS_SIZE"]) for e in envs] == \
        [("0", "0", "2", "0", "2"), ("1", "1", "2", "0", "1"), ("2", "0", "1", "1", "2")]
    assert [e["HOROVOD_HOSTNAME"] for e in envs] == ["n1", "n1", "n2"]
    for e in envs:
        assert (e["HOROVOD_CONTROLLER"], e["HOROVOD_SIZE"], e["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
                e["HOROVOD_GLOO_RENDEZVOUS_PORT"], e["HOROVOD_GLOO_TIMEOUT_SECONDS"]) == \
            ("gloo", "3", "10.0.0.1", "4242", "12")
        assert e["X"] == "1" and e["HOROVOD_GLOO_IFACE"] == "ib0"  # the user's value wins
        assert e["NCCL_SOCKET_IFNAME"] == "eth1,eth0"
        assert "AIAK_GLOO_STORE_PREFIX" not in e
    # Hydra's proxies and the Gloo world need a host's ranks adjacent: say so, do not misplace.
    with pytest.raises(ValueError, match="not contiguous"):
        scheduler_jobs.rank_envs(["a", "b", "a"], "10.0.0.1", 4242)


def test_pickled_names_the_object_that_cannot_travel():
    lock = threading.Lock()

    def uses_lock():
        return lock

    with pytest.raises(TypeError, match=r"function '.*uses_lock' cannot be pickled.*lock"):
        scheduler_jobs.pickled(uses_lock, "function")


@pytest.mark.parametrize("package,extra", [("ray", "ray"), ("pyspark", "spark")])
def test_missing_engine_raises_import_error_naming_the_extra(package, extra):
    module = "aiak_training.ray" if extra == "ray" else "aiak_training.spark"
    # sys.modules[name] = None makes "import name" fail as if it were not installed.
    code = f"import sys; sys.modules[{package!r}] = None; import {module}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert f"pip install 'aiak-training[{extra}]'" in proc.stderr


@pytest.mark.parametrize("shim,target,attr", [("horovod.ray", "aiak_training.ray", "RayExecutor"),
                                              ("horovod.spark", "aiak_training.spark", "run")])
def test_horovod_compat_aliases(shim, target, attr):
    pytest.importorskip("ray" if "ray" in shim else "pyspark",
                        reason=f"the {target.split('.')[-1]} extra is not installed")
    from aiak_training.compat import shim_dir
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([shim_dir(), REPO]))
    code = (f"import {shim} as h, {target} as a; "
            f"assert h.{attr} is a.{attr}; print(h.{attr}.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(target)
