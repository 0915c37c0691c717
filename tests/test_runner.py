"""Unit tests of aiakrun: parsing, host placement, env mapping, command building (no launches)."""
import os
import signal

import pytest

from aiak_training.common.job.ranks import RankIdentity
from aiak_training.common.job.records import (RankFailure, describe_returncode, read_failures,
                                              write_failure)
from aiak_training.runner import launch
from aiak_training.runner.cli.args import (ignored_flags, network_interfaces, parse_args,
                                           unsupported_flags)
from aiak_training.runner.cli.env_map import (exportable_names, flag_env, launcher_env,
                                              parse_env_assignments, prepend_path)
from aiak_training.runner.cli.hosts import (HostSlots, assign_slots, parse_hostfile, parse_hosts,
                                            used_hosts)
from aiak_training.runner.guard.task_wrapper import rank_dir_name, rank_from_env, virtual_host_for
from aiak_training.runner.modes.mpi_flavour import (Flavour, MpiLauncher, parse_flavour,
                                                    parse_major_version)
from aiak_training.runner.modes.mpi_run import LaunchSpec, build_mpi_command
from aiak_training.runner.report.failure import shell_status
from aiak_training.runner.report.line_pump import LineAssembler

CMD = ["/py", "-m", "aiak_training.runner.guard.task_wrapper", "--", "python", "train.py"]
AB = [HostSlots("a", 2), HostSlots("b", 2)]


# --------------------------------------------------------------------------- hosts

def test_parse_hosts():
    assert parse_hosts("server1:2,server-2.x:4") == [HostSlots("server1", 2),
                                                      HostSlots("server-2.x", 4)]


@pytest.mark.parametrize("spec,fragment", [
    ("a", "invalid host entry 'a'"),
    ("a:2,b", "invalid host entry 'b'"),
    ("a:two", "invalid host entry 'a:two'"),
    ("a b:2", "invalid host entry 'a b:2'"),
    ("a:0", "host 'a' in 'a:0' has 0 slots"),
    ("a:1,a:2", "host 'a' is listed more than once"),
    ("", "empty host list"),
])
def test_parse_hosts_rejects(spec, fragment):
    with pytest.raises(ValueError) as err:
        parse_hosts(spec)
    assert fragment in str(err.value)


def test_parse_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1 slots=4\n\n  node2   slots=2  # comment\nnode3\n")
    assert parse_hostfile(str(path)) == [HostSlots("node1", 4), HostSlots("node2", 2),
                                         HostSlots("node3", 1)]
    bad = tmp_path / "bad"
    bad.write_text("node1 slots=4\nnode2 cpus=2\n")
    with pytest.raises(ValueError, match=r"bad:2: cannot parse 'node2 cpus=2'"):
        parse_hostfile(str(bad))


def test_assign_slots_fills_hosts_in_order():
    slots = assign_slots([HostSlots("a", 2), HostSlots("b", 2), HostSlots("c", 1)], 5)
    assert slots == [
        RankIdentity(0, 5, 0, 2, 0, 3, "a"), RankIdentity(1, 5, 1, 2, 0, 2, "a"),
        RankIdentity(2, 5, 0, 2, 1, 3, "b"), RankIdentity(3, 5, 1, 2, 1, 2, "b"),
        RankIdentity(4, 5, 0, 1, 2, 3, "c")]
    partial = assign_slots(AB, 3)
    assert [(s.rank, s.hostname, s.local_rank) for s in partial] == [
        (0, "a", 0), (1, "a", 1), (2, "b", 0)]
    assert used_hosts(partial) == [HostSlots("a", 2), HostSlots("b", 1)]


def test_assign_slots_too_many_ranks():
    with pytest.raises(ValueError, match=r"-np 5 needs more slots than the 4 given by the host "
                                         r"list a:2,b:2"):
        assign_slots(AB, 5)


# --------------------------------------------------------------------------- flavour

MPICH_TEXT = "HYDRA build details:\n    Version:    5.0.2\n    Release Date: ...\n"
OMPI4_TEXT = "mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
OMPI5_TEXT = "mpirun (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
PRRTE_TEXT = "prterun (PMIx Reference RunTime Environment) 3.0.2\n"
IMPI_TEXT = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\nHYDRA build\n"
SMPI_TEXT = "mpirun (IBM Spectrum MPI) 10.4.0.0\n"


@pytest.mark.parametrize("text,flavour", [
    (MPICH_TEXT, Flavour.MPICH), ("MPICH Version: 4.1", Flavour.MPICH),
    (OMPI4_TEXT, Flavour.OPENMPI), (OMPI5_TEXT, Flavour.OPENMPI),
    ("mpirun (OpenRTE) 2.1.1", Flavour.OPENMPI), (PRRTE_TEXT, Flavour.OPENMPI),
    (IMPI_TEXT, Flavour.INTEL), (SMPI_TEXT, Flavour.SPECTRUM), ("something else", None)])
def test_parse_flavour(text, flavour):
    assert parse_flavour(text) is flavour


def test_parse_major_version():
    assert parse_major_version(Flavour.OPENMPI, OMPI4_TEXT) == 4
    assert parse_major_version(Flavour.OPENMPI, OMPI5_TEXT) == 5
    assert parse_major_version(Flavour.MPICH, MPICH_TEXT) == 5


# --------------------------------------------------------------------------- flags -> env

def test_every_tunable_flag_maps_to_its_variable():
    args = parse_args([
        "-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
        "--cache-capacity", "0", "--hierarchical-allreduce", "--no-hierarchical-allgather",
        "--timeline-filename", "/tmp/tl.json", "--timeline-mark-cycles", "--no-stall-check",
        "--stall-check-warning-time-seconds", "15", "--stall-check-shutdown-time-seconds", "90",
        "--log-level", "debug", "--log-without-timestamp", "--mpi-threads-disable", "--tcp",
        "--network-interfaces", "eth0,eth1", "--network-interface", "ib0",
        "--start-timeout", "45", "--overlap-update", "--allreduce-algo", "hierarchical",
        "--fused-optimizer", "python", "x.py"])
    assert flag_env(args, {}) == {
        "HOROVOD_FUSION_THRESHOLD": "33554432",
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "0",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_MPI_THREADS_DISABLE": "1",
        "HOROVOD_TIMELINE": "/tmp/tl.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "15",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90",
        "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_LOG_HIDE_TIME": "1",
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "eth0,eth1,ib0",
        "HOROVOD_START_TIMEOUT": "45",
        "AIAK_OVERLAP_UPDATE": "1",
        "AIAK_ALLREDUCE_ALGO": "hierarchical",
        "AIAK_FUSED_OPTIMIZER": "1",
        "PYTHONUNBUFFERED": "1",
    }
    assert args.command == ["python", "x.py"]


def test_defaults_set_only_start_timeout_and_unbuffered():
    args = parse_args(["-np", "2", "--no-hierarchical-allreduce", "--no-timeline-mark-cycles",
                       "--log-with-timestamp", "cmd"])
    assert flag_env(args, {}) == {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0",
                                  "HOROVOD_TIMELINE_MARK_CYCLES": "0",
                                  "HOROVOD_LOG_HIDE_TIME": "0",
                                  "HOROVOD_START_TIMEOUT": "30", "PYTHONUNBUFFERED": "1"}
    # Horovod's own variable is the default for --start-timeout.
    assert flag_env(parse_args(["-np", "1", "cmd"]),
                    {"HOROVOD_START_TIMEOUT": "99"})["HOROVOD_START_TIMEOUT"] == "99"


def test_parse_args_forms():
    args = parse_args(["-np", "4", "-H", "a:2,b:2", "-p", "2222", "-i", "/k", "-x", "A=1",
                       "-x", "B", "--mpi-args=-verbose -foo", "--verbose", "--mpi",
                       "--", "python", "t.py", "--lr", "0.1"])
    assert (args.num_proc, args.hosts, args.ssh_port, args.ssh_identity_file) == (
        4, "a:2,b:2", 2222, "/k")
    assert args.env_vars == ["A=1", "B"]
    assert args.mpi_args == "-verbose -foo"
    assert args.command == ["python", "t.py", "--lr", "0.1"]
    assert network_interfaces(parse_args(["--network-interface", "eth0", "--network-interface",
                                          "eth0,eth1", "c"])) == ["eth0", "eth1"]
    with pytest.raises(SystemExit):
        parse_args(["-H", "a:1", "--hostfile", "f", "cmd"])  # mutually exclusive


def test_unsupported_flags_explain_themselves():
    assert unsupported_flags(parse_args(["-np", "2", "--gloo", "cmd"])) == []  # Gloo mode
    assert unsupported_flags(parse_args(["--min-np", "2", "cmd"])) == []  # elastic mode
    assert unsupported_flags(parse_args(["-np", "2", "cmd"])) == []


def test_performance_only_flags_are_accepted_but_ignored():
    # The autotune flags work (tests/test_autotune.py); these others are only accepted.
    args = parse_args(["-np", "1", "--autotune", "--autotune-log-file", "a.csv", "cmd"])
    assert ignored_flags(args) == []
    assert args.command == ["cmd"] and unsupported_flags(args) == []
    args = parse_args(["-np", "1", "--no-autotune", "--num-nccl-streams", "2",
                       "--thread-affinity", "1", "--torus-allreduce", "-prefix-timestamp",
                       "cmd", "--num-nccl-streams"])
    assert ignored_flags(args) == ["--num-nccl-streams", "--thread-affinity",
                                   "--torus-allreduce", "--prefix-output-with-timestamp"]
    assert args.command == ["cmd", "--num-nccl-streams"]


def test_stall_check_and_log_timestamp_aliases():
    env = flag_env(parse_args(["-np", "1", "--stall-check", "--log-hide-timestamp", "cmd"]), {})
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "0" and env["HOROVOD_LOG_HIDE_TIME"] == "1"
    env = flag_env(parse_args(["-np", "1", "--no-stall-check", "--no-log-hide-timestamp",
                               "cmd"]), {})
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1" and env["HOROVOD_LOG_HIDE_TIME"] == "0"
    assert "HOROVOD_STALL_CHECK_DISABLE" not in flag_env(parse_args(["-np", "1", "cmd"]), {})


def test_env_assignments():
    values, missing = parse_env_assignments(["A=1", "B", "C", "D=x=y"], {"B": "from-shell"})
    assert values == {"A": "1", "B": "from-shell", "D": "x=y"}
    assert missing == ["C"]
    with pytest.raises(ValueError, match="'1A' is not a valid environment variable name"):
        parse_env_assignments(["1A=2"], {})


def test_launcher_env_drops_per_rank_identity_and_exports():
    env = launcher_env({"PATH": "/bin", "HOROVOD_HOSTNAME": "stale", "OLDPWD": "/x",
                        "BASH_FUNC_f%%": "() { :; }", "CUDA_VISIBLE_DEVICES": "0,1",
                        "NV_CUDA_VISIBLE_DEVICES": "2"}, {"HOROVOD_CYCLE_TIME": "2"})
    assert env == {"PATH": "/bin", "OLDPWD": "/x", "BASH_FUNC_f%%": "() { :; }",
                   "CUDA_VISIBLE_DEVICES": "0,1", "NV_CUDA_VISIBLE_DEVICES": "2",
                   "HOROVOD_CYCLE_TIME": "2"}
    assert exportable_names(env) == ["HOROVOD_CYCLE_TIME", "PATH"]
    assert prepend_path("/s", "/a:/s:/b") == "/s:/a:/b"
    assert prepend_path("/s", None) == "/s"


# --------------------------------------------------------------------------- commands

def test_mpich_command():
    spec = LaunchSpec("mpiexec", Flavour.MPICH, 4, AB, CMD,
                      set_env={"HOROVOD_CYCLE_TIME": "2", "PYTHONUNBUFFERED": "1"},
                      extra_mpi_args=["-verbose"])
    assert build_mpi_command(spec) == [
        "mpiexec", "-l", "-n", "4", "-hosts", "a:2,b:2", "-bind-to", "none", "-genvall",
        "-genv", "HOROVOD_CYCLE_TIME", "2", "-genv", "PYTHONUNBUFFERED", "1", "-verbose", *CMD]


def test_mpich_virtual_hosts_use_mpmd_with_per_host_identity():
    spec = LaunchSpec("mpiexec", Flavour.MPICH, 4, AB, CMD, set_env={"X": "1"},
                      virtual_hosts=True)
    assert build_mpi_command(spec) == [
        "mpiexec", "-l", "-hosts", "localhost:4", "-bind-to", "none", "-genvall",
        "-genv", "X", "1",
        "-n", "2", "-env", "HOROVOD_HOSTNAME", "a", *CMD, ":",
        "-n", "2", "-env", "HOROVOD_HOSTNAME", "b", *CMD]


def test_mpich_emulated_cluster_and_ssh_agent():
    spec = LaunchSpec("mpiexec", Flavour.MPICH, 4, AB, CMD,
                      cluster_launcher_exec="/run/agent", iface="aiak0")
    assert build_mpi_command(spec) == [
        "mpiexec", "-l", "-n", "4", "-hosts", "a:2,b:2", "-bind-to", "none",
        "-launcher", "ssh", "-launcher-exec", "/run/agent", "-iface", "aiak0", "-genvall", *CMD]
    spec = LaunchSpec("mpiexec", Flavour.MPICH, 2, [HostSlots("a", 2)], CMD, ssh_port=2222,
                      ssh_exec="/tmp/run/ssh", nics=["eth1", "eth2"],
                      binding_args=["-bind-to", "core"])
    assert build_mpi_command(spec) == [
        "mpiexec", "-l", "-n", "2", "-hosts", "a:2", "-bind-to", "core",
        "-launcher", "ssh", "-launcher-exec", "/tmp/run/ssh", "-iface", "eth1", "-genvall", *CMD]


def test_intel_mpi_command():
    spec = LaunchSpec("mpirun", Flavour.INTEL, 4, AB, CMD, set_env={"A": "1"}, ssh_port=22,
                      ssh_identity_file="/id")
    assert build_mpi_command(spec) == [
        "mpirun", "-l", "-n", "4", "-hosts", "a,b", "-ppn", "2",
        "-bootstrap", "ssh", "-bootstrap-exec-args", "-p 22 -i /id",
        "-genvall", "-genv", "A", "1", *CMD]
    virtual = LaunchSpec("mpirun", Flavour.INTEL, 3, [HostSlots("a", 2), HostSlots("b", 1)],
                         CMD, virtual_hosts=True)
    assert build_mpi_command(virtual) == [
        "mpirun", "-l", "-hosts", "localhost", "-ppn", "3", "-genvall",
        "-n", "2", "-env", "HOROVOD_HOSTNAME", "a", *CMD, ":",
        "-n", "1", "-env", "HOROVOD_HOSTNAME", "b", *CMD]
    uneven = LaunchSpec("mpirun", Flavour.INTEL, 3, [HostSlots("a", 2), HostSlots("b", 1)], CMD)
    with pytest.raises(ValueError, match="Intel MPI needs the same number of ranks on every "
                                         "host"):
        build_mpi_command(uneven)


def test_open_mpi_4_command():
    spec = LaunchSpec("mpirun", Flavour.OPENMPI, 4, AB, CMD, set_env={"HOROVOD_CYCLE_TIME": "2"},
                      export_names=["HOROVOD_CYCLE_TIME", "PATH", "PYTHONPATH"],
                      launcher_major_version=4, run_as_root=True, ssh_port=2222,
                      ssh_identity_file="/id", nics=["eth0", "eth1"])
    assert build_mpi_command(spec) == [
        "mpirun", "--allow-run-as-root", "--tag-output", "-np", "4", "-H", "a:2,b:2",
        "--bind-to", "none", "--map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", "^openib",
        "-mca", "plm_rsh_args", "-p 2222 -i /id", "-mca", "btl_tcp_if_include", "eth0,eth1",
        "-x", "PATH", "-x", "PYTHONPATH", "-x", "HOROVOD_CYCLE_TIME=2", *CMD]


def test_open_mpi_5_virtual_hosts_oversubscribed():
    spec = LaunchSpec("mpirun", Flavour.OPENMPI, 4, AB, CMD, export_names=["PATH"],
                      launcher_major_version=5, oversubscribe=True, virtual_hosts=True)
    assert build_mpi_command(spec) == [
        "mpirun", "--tag-output", "-np", "4", "-H", "localhost:4", "--bind-to", "none",
        "--map-by", "slot", "--oversubscribe", "-x", "PATH",
        "-x", "AIAK_VIRTUAL_HOST_MAP=a:2,b:2", *CMD]


def test_spectrum_and_large_cluster():
    hosts = [HostSlots(f"n{i}", 1) for i in range(64)]
    spec = LaunchSpec("mpirun", Flavour.SPECTRUM, 64, hosts, CMD, tcp=True)
    cmd = build_mpi_command(spec)
    assert cmd[:5] == ["mpirun", "--tag-output", "-np", "64", "-H"]
    assert cmd[6:] == ["--bind-to", "socket", "--map-by", "socket", "--rank-by", "core", "-tcp",
                       "-mca", "plm_rsh_no_tree_spawn", "true",
                       "-mca", "plm_rsh_num_concurrent", "64", *CMD]


def test_command_rejects_inconsistent_assignment():
    with pytest.raises(ValueError, match="num_proc 3 does not match"):
        build_mpi_command(LaunchSpec("mpiexec", Flavour.MPICH, 3, AB, CMD))


# --------------------------------------------------------------------------- prepare()

MPICH = MpiLauncher("/usr/bin/mpiexec", Flavour.MPICH, MPICH_TEXT, 5)
OMPI = MpiLauncher("/usr/bin/mpirun", Flavour.OPENMPI, OMPI4_TEXT, 4)


def _prepare(argv, environ, launcher=MPICH, tmp_path=None):
    return launch.prepare(parse_args(argv), environ, launcher, str(tmp_path))


def test_prepare_emulated_cluster_hook(tmp_path):
    environ = {"PATH": "/bin", "AIAK_CLUSTER_LAUNCHER_EXEC": "/run/agent",
               "AIAK_CLUSTER_IFACE": "aiak0", "AIAK_CLUSTER_HOSTS": "192.0.2.1:2,192.0.2.2:2",
               "HOROVOD_HOSTNAME": "stale"}
    spec, env = _prepare(["-np", "4", "python", "t.py"], environ, tmp_path=tmp_path)
    assert spec.hosts == [HostSlots("192.0.2.1", 2), HostSlots("192.0.2.2", 2)]
    assert (spec.cluster_launcher_exec, spec.iface) == ("/run/agent", "aiak0")
    assert "HOROVOD_HOSTNAME" not in env
    assert env["AIAK_FAILURE_DIR"] == os.path.join(str(tmp_path), "failures")
    assert spec.command[1:] == ["-m", "aiak_training.runner.guard.task_wrapper", "--", "python",
                                "t.py"]
    # -H given: the cluster's host list is not used, the launch agent still is.
    spec, _ = _prepare(["-np", "2", "-H", "192.0.2.2:2", "cmd"], environ, tmp_path=tmp_path)
    assert spec.hosts == [HostSlots("192.0.2.2", 2)]
    assert spec.cluster_launcher_exec == "/run/agent"
    # Not MPICH: hook ignored.
    spec, _ = _prepare(["-np", "2", "cmd"], environ, launcher=OMPI, tmp_path=tmp_path)
    assert spec.cluster_launcher_exec is None and spec.hosts == [HostSlots("localhost", 2)]


def test_prepare_virtual_hosts_from_env_and_x_vars(tmp_path):
    spec, env = _prepare(["-np", "3", "-H", "a:2,b:2", "-x", "FOO=bar", "cmd"],
                         {"PATH": "/bin", "AIAK_VIRTUAL_HOSTS": "1"}, tmp_path=tmp_path)
    assert spec.virtual_hosts and spec.hosts == [HostSlots("a", 2), HostSlots("b", 1)]
    assert spec.set_env["FOO"] == "bar" and env["FOO"] == "bar"
    with pytest.raises(launch.UsageError, match="conflicts with --virtual-hosts"):
        _prepare(["-np", "2", "--virtual-hosts", "-x", "HOROVOD_HOSTNAME=z", "cmd"], {},
                 tmp_path=tmp_path)


def test_prepare_ssh_agent_for_mpich(tmp_path):
    spec, _ = _prepare(["-np", "2", "-H", "h1:1,h2:1", "-p", "2222", "-i", "/my key", "cmd"],
                       {"PATH": "/bin"}, tmp_path=tmp_path)
    assert spec.ssh_exec == os.path.join(str(tmp_path), "ssh")
    with open(spec.ssh_exec) as f:
        assert f.read() == "#!/bin/sh\nexec ssh -p 2222 -i '/my key' \"$@\"\n"
    assert os.access(spec.ssh_exec, os.X_OK)


def test_prepare_oversubscribes_open_mpi_only_when_local(tmp_path):
    many = str((os.cpu_count() or 1) + 1)
    spec, _ = _prepare(["-np", many, "cmd"], {"PATH": "/bin"}, launcher=OMPI, tmp_path=tmp_path)
    assert spec.oversubscribe and spec.run_as_root == (os.geteuid() == 0)
    spec, _ = _prepare(["-np", many, "-H", f"remote1:{many}", "cmd"], {"PATH": "/bin"},
                       launcher=OMPI, tmp_path=tmp_path)
    assert not spec.oversubscribe


# --------------------------------------------------------------------------- wrapper helpers

def test_rank_and_host_identity_helpers():
    assert rank_from_env({"PMI_RANK": "3", "OMPI_COMM_WORLD_RANK": "5"}) == 3
    assert rank_from_env({"OMPI_COMM_WORLD_RANK": "5"}) == 5
    assert rank_from_env({"PMIX_RANK": "6"}) == 6
    assert rank_from_env({"HOROVOD_RANK": "7"}) == 7
    assert rank_from_env({}) is None
    assert [virtual_host_for(r, "a:2,b:1") for r in range(4)] == ["a", "a", "b", None]
    assert rank_dir_name(3, 4) == "rank.3"
    assert rank_dir_name(3, 12) == "rank.03"


def test_failure_records(tmp_path):
    assert describe_returncode(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_returncode(3) == "exit code 3"
    assert (shell_status(-9), shell_status(3), shell_status(0)) == (137, 3, 0)
    write_failure(str(tmp_path), RankFailure(2, "b", 3, 20.0))
    write_failure(str(tmp_path), RankFailure(1, "a", -9, 10.0))
    write_failure(str(tmp_path / "missing"), RankFailure(0, "a", 1, 0.0))  # silently skipped
    records = read_failures(str(tmp_path))
    assert [r.describe() for r in records] == ["rank 1 (host a) exited with signal SIGKILL",
                                               "rank 2 (host b) exited with exit code 3"]
    assert not (tmp_path / "missing").exists()


def test_line_assembler_releases_whole_lines():
    lines = LineAssembler(max_pending=8)
    assert lines.feed(b"abc") == b"" and lines.pending
    assert lines.feed(b"\nde") == b"abc\n"
    assert lines.feed(b"f\ngh\ni") == b"def\ngh\n"
    assert lines.feed(b"\r 50%") == b"i\r"  # progress bars: a carriage return ends a line
    assert lines.flush() == b" 50%" and not lines.pending
    assert lines.feed(b"0123456789") == b"0123456789"  # longer than max_pending: not held
    assert lines.flush() == b""
