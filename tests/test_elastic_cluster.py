"""Elastic training on the emulated cluster (network namespaces, 1 Gbit/s links; root only,
skipped with the reason elsewhere).  Every job runs ``aiakrun`` on node 0 over at least 3
emulated nodes; a node "dies" when every process in its namespace gets SIGKILL at once.

* a node killed, then a node added: exact replay of the committed steps (an unmodified
  Elastic Horovod script under ``--horovod-compat``);
* fewer than --min-np slots: a bounded wait, then every process exits non-zero;
* the reset limit: a clear error;
* the digits examples (torch, Keras) through one removal and one addition reach the accuracy
  of the non-elastic run.
"""
import os
import re
import subprocess
import sys

from launch import REPO, env_with

from elastic_support import (SCRIPT, accuracy, check_exact, cluster_job, discovery_script,
                             emulated_cluster, exact_result, kill_node, write_hosts)

EXACT_ENV = {"STEP_SLEEP": "0.25", "COMMIT_EVERY": "2", "EPOCHS": "6"}


def test_node_killed_then_node_added_on_emulated_cluster(tmp_path):
    """Starts on nodes 0-2, node 2 dies mid-epoch, the job goes on with nodes 0-1 from the
    last commit, then discovery lists node 3 and the job grows to it within two commits."""
    with emulated_cluster(4) as cluster:
        hosts = cluster.hosts
        script, host_file = discovery_script(tmp_path, [f"{h}:1" for h in hosts[:3]])
        job = cluster_job(cluster, ["-np", "3", "--min-np", "2", "--max-np", "3",
                                    "--horovod-compat", "--host-discovery-script", script,
                                    sys.executable, SCRIPT], tmp_path,
                          {**EXACT_ENV, "ELASTIC_EXACT_HOROVOD": "1"})
        before = job.wait_steps(4, timeout=180)
        assert kill_node(cluster, 2)
        job.wait_log(f"lost host {hosts[2]}", timeout=60)
        job.wait_log("round 2: 2 rank(s)", timeout=120)
        write_hosts(host_file, [f"{h}:1" for h in (hosts[0], hosts[1], hosts[3])])
        job.wait_log(f"hosts updated (added {hosts[3]}:0)", timeout=180)
        announced = job.steps()[0]
        job.wait_log(f"round 3: 3 rank(s) on {hosts[0]}, {hosts[1]}, {hosts[3]}", timeout=180)
        code = job.finish(timeout=300)
        log = job.log()
        assert code == 0, log[-4000:]
        assert re.search(rf"lost host {re.escape(hosts[2])}: worker \S+ \(host "
                         rf"{re.escape(hosts[2])} slot 0, rank 2\) exited with signal SIGKILL",
                         log), log[-4000:]
        out, history = exact_result(job)
        sizes = [h[1] for h in history]
        two = sizes.index(2)
        three = sizes.index(3, two)
        # No committed step is lost: 3 ranks up to at least the commit seen before the kill,
        # then 2, then 3 again, and nothing else.
        assert two >= before and set(sizes[:two]) == {3} and set(sizes[two:three]) == {2}
        assert set(sizes[three:]) == {3} and out["size"] == 3
        # The new node joins at the first commit after the announcement (commits are 2 steps
        # apart; one more commit of slack for the progress file lagging the log).
        assert three <= announced + 2 * int(EXACT_ENV["COMMIT_EVERY"]), (three, announced)
        check_exact(history, out["params"], int(EXACT_ENV["EPOCHS"]))


def _lose_node_and_fail(cluster, tmp_path, flags):
    """A 3-node job (``flags`` added) that loses node 2 once training runs: (exit code, log)."""
    script, _ = discovery_script(tmp_path, [f"{h}:1" for h in cluster.hosts])
    job = cluster_job(cluster, ["-np", "3", *flags, "--host-discovery-script", script,
                                sys.executable, SCRIPT], tmp_path, {**EXACT_ENV, "EPOCHS": "50"})
    job.wait_steps(2, timeout=180)
    assert kill_node(cluster, 2)
    code = job.finish(timeout=120)
    return code, job.log()


def test_fewer_than_min_np_fails_after_elastic_timeout_on_emulated_cluster(tmp_path):
    with emulated_cluster(3) as cluster:
        hosts = cluster.hosts
        code, log = _lose_node_and_fail(cluster, tmp_path,
                                        ["--min-np", "3", "--elastic-timeout", "3"])
        assert code == 1, (code, log[-4000:])
        assert "2 slot(s) usable, fewer than the --min-np of 3: waiting up to 3 s" in log
        shortfall = ("only 2 slot(s) usable, fewer than the --min-np of 3, for 3 s "
                     f"(--elastic-timeout); lost hosts: {hosts[2]}")
        assert f"aiakrun: error: elastic job failed: {shortfall}" in log, log[-4000:]
        # The surviving workers were waiting for their next world: each exits non-zero with
        # the reason.
        assert log.count(f"worker.ElasticJobStopped: elastic job failed: {shortfall}") == 2, \
            log[-4000:]
        # ... and each node's wrapper repeats that exception in its one-line report.
        for host in hosts[:2]:
            assert (f"[{host}:0]: aiakrun: a rank (host {host}) raised ElasticJobStopped: "
                    f"elastic job failed: {shortfall} (exit code 1)") in log, log[-4000:]


def test_reset_limit_stops_the_job_on_emulated_cluster(tmp_path):
    with emulated_cluster(3) as cluster:
        code, log = _lose_node_and_fail(cluster, tmp_path, ["--min-np", "2", "--reset-limit",
                                                            "0"])
        assert code == 1, (code, log[-4000:])
        assert f"lost host {cluster.hosts[2]}" in log, log[-4000:]
        assert ("aiakrun: error: elastic job failed: reset limit reached: the job was reset 0 "
                "time(s) and another reset is needed (--reset-limit 0)") in log, log[-4000:]
        assert "round 2" not in log


# ---- the digits examples through one removal and one addition ---------------------------------
def _digits_through_removal_and_addition(tmp_path, example, extra_env, epochs="15",
                                         step_sleep="0.05"):
    with emulated_cluster(3) as cluster:
        hosts = cluster.hosts
        script, host_file = discovery_script(tmp_path, [f"{h}:1" for h in hosts[:2]])
        progress = str(tmp_path / "digits_progress")
        job = cluster_job(cluster, ["-np", "2", "--min-np", "1", "--max-np", "2",
                                    "--host-discovery-script", script, sys.executable,
                                    os.path.join(REPO, "examples", example), "--epochs", epochs,
                                    "--step-sleep", step_sleep],
                          tmp_path, {"DIGITS_PROGRESS": progress, **extra_env})
        job.progress = progress  # "epoch step size": the first number is the epoch
        job.wait_steps(2, timeout=240)
        assert kill_node(cluster, 1)
        job.wait_log(f"round 2: 1 rank(s) on {hosts[0]} (reset 1)", timeout=120)
        write_hosts(host_file, [f"{hosts[0]}:1", f"{hosts[2]}:1"])
        job.wait_log(f"round 3: 2 rank(s) on {hosts[0]}, {hosts[2]}", timeout=180)
        code = job.finish(timeout=400)
        log = job.log()
        assert code == 0, log[-4000:]
        assert f"lost host {hosts[1]}" in log
        elastic = accuracy(log)
    # The reference: the same training run by plain (non-elastic) `aiakrun -np 2`.  Not
    # examples/pytorch_digits.py: there every rank takes a whole pass over the data per epoch,
    # where the elastic sampler splits one pass between the ranks, so on 2 ranks the torch
    # example lands ~2.5 points lower than pytorch_digits.py even without a fault.
    ref = subprocess.run([sys.executable, "-m", "aiak_training.runner.launch", "-np", "2",
                          sys.executable, os.path.join(REPO, "examples", example),
                          "--epochs", epochs],
                         env=env_with(extra_env), cwd=REPO, capture_output=True, text=True,
                         timeout=400)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    assert "aiakrun: elastic:" not in ref.stdout + ref.stderr
    plain = accuracy(ref.stdout + ref.stderr)
    # Same data, model and epochs; the elastic run saw 2, then 1, then 2 ranks, so its steps
    # differ: the same accuracy within a few test samples (450 in the test set).
    assert plain > 90.0 and abs(elastic - plain) <= 3.0, (elastic, plain)


def test_torch_digits_elastic_matches_non_elastic_accuracy_on_emulated_cluster(tmp_path):
    # 25 epochs: at 15 the 2-rank run is not converged yet (~95% without a fault, and a
    # couple of points either way with one, depending on where the faults hit).
    _digits_through_removal_and_addition(tmp_path, "pytorch_digits_elastic.py", {}, epochs="25")


def test_keras_digits_elastic_matches_non_elastic_accuracy_on_emulated_cluster(tmp_path):
    _digits_through_removal_and_addition(tmp_path, "keras_digits_elastic.py",
                                         {"TF_CPP_MIN_LOG_LEVEL": "2"}, step_sleep="0.02")
