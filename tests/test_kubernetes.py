"""examples/kubernetes: the Kubeflow MPI Operator job, as far as it can be checked here.

* Each MPIJob manifest parses and has what the operator (v2, ``kubeflow.org/v2beta1``)
  needs: a launcher and workers from one image, workers without a command (the operator runs
  sshd there), ranks = workers x slotsPerWorker, the hostfile the operator mounts.
* The launchers' command lines run as the operator runs them, on an emulated cluster whose
  node 0 stands for the launcher pod and nodes 1 and 2 for the worker pods, with a hostfile
  written in the operator's MPICH format (``host:slots``; IP addresses in place of the pods'
  DNS names, which need the cluster's DNS).  The program is swapped for a probe that reports
  where each rank runs (the manifests' own program, examples/pytorch_digits.py, is tested
  under aiakrun elsewhere).

Not run here: a Kubernetes cluster, the operator, the image build (docker), ssh between pods.
"""
import os
import re
import shutil
import sys
import sysconfig

import pytest

from launch import REPO, clean_env, require_emulation

yaml = pytest.importorskip("yaml")

HERE = os.path.join(REPO, "examples", "kubernetes")
MANIFESTS = {"aiakrun": "mpijob.yaml", "mpirun": "mpijob-mpirun.yaml"}
HOSTFILE = "/etc/mpi/hostfile"   # where the operator mounts the hostfile in the launcher
# One write per rank, so that a plain mpirun cannot interleave the two ranks' lines.
PROBE = ("import os, socket, torch, aiak_training.torch as hvd; hvd.init(); "
         "s = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum); "
         "os.write(1, ('probe %d %d %s %d\\n' % (hvd.rank(), hvd.size(), "
         "socket.gethostname(), int(s.item()))).encode())")


def manifest(launcher: str) -> dict:
    with open(os.path.join(HERE, MANIFESTS[launcher]), encoding="utf-8") as f:
        docs = list(yaml.safe_load_all(f))
    assert len(docs) == 1
    return docs[0]


def containers(job: dict, role: str) -> list:
    return job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"]


def launcher_command(job: dict) -> list:
    main = containers(job, "Launcher")[0]
    return [str(a) for a in main.get("command", []) + main.get("args", [])]


@pytest.mark.parametrize("launcher", MANIFESTS)
def test_manifest_has_what_the_operator_needs(launcher):
    job = manifest(launcher)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    spec = job["spec"]
    # MPICH: the hostfile's "host:slots" lines, read by aiakrun and by MPICH's hydra.
    assert spec["mpiImplementation"] == "MPICH"
    assert spec["sshAuthMountPath"] == "/root/.ssh"  # the image runs as root
    assert set(spec["mpiReplicaSpecs"]) == {"Launcher", "Worker"}
    assert spec["mpiReplicaSpecs"]["Launcher"]["replicas"] == 1
    (main,), (worker,) = containers(job, "Launcher"), containers(job, "Worker")
    assert main["image"] == worker["image"]
    assert "command" not in worker and "args" not in worker  # the operator starts sshd
    assert main["workingDir"] == worker["workingDir"] == "/opt/aiak-training"
    cmd = launcher_command(job)
    ranks = spec["mpiReplicaSpecs"]["Worker"]["replicas"] * spec["slotsPerWorker"]
    flag = "-np" if launcher == "aiakrun" else "-n"
    assert cmd[0] == launcher and int(cmd[cmd.index(flag) + 1]) == ranks
    if launcher == "aiakrun":
        assert cmd[cmd.index("--hostfile") + 1] == HOSTFILE
    assert os.path.isfile(os.path.join(REPO, cmd[-1]))  # the program, in the image's checkout


@pytest.mark.parametrize("line", ["{host}:2", "{host} slots=2"])
def test_aiakrun_reads_the_operators_hostfile_formats(tmp_path, line):
    # MPICH / Intel MPI jobs get "host:slots", Open MPI jobs "host slots=N".
    from aiak_training.runner.cli.hosts import HostSlots, parse_hostfile
    names = [f"aiak-digits-worker-{i}.aiak-digits-worker.default.svc" for i in range(2)]
    (tmp_path / "hostfile").write_text("".join(line.format(host=h) + "\n" for h in names))
    assert parse_hostfile(str(tmp_path / "hostfile")) == [HostSlots(h, 2) for h in names]


def test_image_is_built_from_this_checkout():
    with open(os.path.join(HERE, "Dockerfile"), encoding="utf-8") as f:
        text = f.read()
    assert "COPY . ." in text and 'pip install --no-cache-dir -e ".[examples]"' in text
    assert "WORKDIR /opt/aiak-training" in text
    assert "openssh-server" in text and "openssh-client" in text


def _local(cmd: list) -> list:
    """The image's command with this machine's interpreter and launchers."""
    scripts = sysconfig.get_path("scripts")
    out = []
    for word in cmd:
        if word == "python3":
            out.append(sys.executable)
        elif word in ("aiakrun", "mpirun"):
            found = os.path.join(scripts, word)
            out.append(found if os.path.exists(found) else shutil.which(word))
        else:
            out.append(word)
    return out


def test_launcher_commands_run_on_an_emulated_cluster(tmp_path):
    require_emulation()
    from aiak_training.testing.cluster import EmulatedCluster
    with EmulatedCluster(3, 1, "1gbit", verify="off", log=None) as cluster:
        job = manifest("aiakrun")
        slots = job["spec"]["slotsPerWorker"]
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"{ip}:{slots}\n" for ip in cluster.hosts[1:]))
        workers = sorted(cluster.node_names[1:])
        # As the operator sets it in the launcher for mpiImplementation MPICH.
        env = {**clean_env(OMP_NUM_THREADS="1"), "HYDRA_HOST_FILE": str(hostfile)}
        for launcher in MANIFESTS:
            cmd = _local(launcher_command(manifest(launcher)))
            cmd = [str(hostfile) if w == HOSTFILE else w for w in cmd]
            probe = cmd[:-1] + ["-c", PROBE]  # the program swapped for a placement probe
            proc = cluster.run(probe, env=env, timeout=180, capture_output=True, text=True,
                               cwd=REPO)
            assert proc.returncode == 0, (launcher, proc.stdout[-3000:], proc.stderr[-3000:])
            seen = sorted(re.findall(r"probe (\d) 2 (\S+) 2", proc.stdout))
            assert [r for r, _ in seen] == ["0", "1"], (launcher, proc.stdout[-3000:])
            assert sorted(h for _, h in seen) == workers  # the workers, not the launcher pod
