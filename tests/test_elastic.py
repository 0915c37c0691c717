"""Elastic training: the API in one process, and one real elastic job on virtual hosts.

The multi-process test runs ``aiakrun --host-discovery-script ... --virtual-hosts`` on this
machine (every worker local, each with its own host identity; no root needed), kills a host's
workers with SIGKILL mid-epoch, and checks the final parameters against an exact
single-process replay of the committed steps (tests/scripts/elastic_exact.py).  The elastic
scenarios (node lost, node added, fewer than --min-np, reset limit, the digits examples) run
on the emulated network cluster in tests/test_elastic_cluster.py.
"""
import re
import sys
import threading

import pytest
import torch

from aiak_training.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from aiak_training.common.job.ranks import RankIdentity
from aiak_training.elastic import ObjectState, run_fn
from aiak_training.elastic import run as run_module
from aiak_training.elastic.state import HostUpdateResult
from aiak_training.runner.cli.args import parse_args
from aiak_training.runner.modes.elastic.discovery import (DiscoveryError, HostDiscoveryScript,
                                                          parse_hosts_output)
from aiak_training.runner.modes.elastic.hosts import Blacklist, HostOrder, assign_ranks, plan_slots
from aiak_training.runner.modes.elastic.launch import elastic_requested, settings_from_args

from elastic_support import (SCRIPT, ElasticJob, check_exact, discovery_script, exact_result,
                             kill_host)


def _identity_bcast(obj):
    return obj


def _state(**kwargs) -> ObjectState:
    return ObjectState(bcast_object=_identity_bcast, get_rank=lambda: 0, **kwargs)


# ---- state objects --------------------------------------------------------------------------
def test_object_state_commit_restore_and_sync():
    state = _state(epoch=0, seen=[1])
    state.epoch, state.seen = 3, [1, 2]
    state.commit()
    state.epoch = 9
    state.seen.append(99)  # mutated in place after the commit
    state.restore()
    assert (state.epoch, state.seen) == (3, [1, 2])
    # sync takes rank 0's committed values
    other = ObjectState(bcast_object=lambda obj: {k: v for k, v in state._saved_state.items()},
                        get_rank=lambda: 1, epoch=0, seen=[])
    other.sync()
    assert (other.epoch, other.seen) == (3, [1, 2])


def test_unpicklable_attribute_fails_at_commit_naming_it():
    state = _state(epoch=1, handle=None)
    state.epoch = 2
    state.handle = threading.Lock()
    with pytest.raises(TypeError, match="elastic state attribute 'handle' cannot be pickled"):
        state.commit()
    state.restore()  # the previous commit is intact
    assert (state.epoch, state.handle) == (1, None)


def test_check_host_updates_raises_on_every_change_once():
    state = _state(x=1)
    state.commit()  # nothing pending
    state.on_hosts_updated(1, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is False  # new hosts need the state
    state.commit()  # already seen
    state.on_hosts_updated(1, HostUpdateResult.removed)  # stale timestamp: ignored
    state.commit()
    state.on_hosts_updated(2, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert info.value.skip_sync is True  # only removals: survivors hold the state
    state.on_hosts_updated(3, HostUpdateResult.removed)
    state.on_hosts_updated(4, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert info.value.skip_sync is False


def test_rank0_decides_host_updates():
    # Rank 0 saw nothing: a notification only this rank got does not interrupt it.
    state = ObjectState(bcast_object=lambda obj: (0, 0, 0), get_rank=lambda: 1, x=1)
    state.on_hosts_updated(5, HostUpdateResult.added)
    state.commit()


def test_run_fn_without_elastic_mode_runs_once(monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    calls, resets = [], []
    state = _state(n=0)

    def train(state, value):
        calls.append(value)
        raise HorovodInternalError("peer died")

    with pytest.raises(HorovodInternalError):
        run_fn(train, lambda: resets.append(1))(state, 7)
    assert calls == [7] and resets == []


def test_run_fn_restores_resets_and_retries(monkeypatch):
    monkeypatch.setattr(run_module, "elastic_mode", lambda: True)
    events = []
    state = _state(step=0)
    state.register_reset_callbacks([lambda: events.append(("callback", state.step))])
    original_sync = state.sync
    state.sync = lambda: (events.append("sync"), original_sync())
    failures = iter([HorovodInternalError("lost"), HostsUpdatedInterrupt(True),
                     HostsUpdatedInterrupt(False), None])

    def train(state):
        state.step += 1
        if state.step % 2 == 0:
            state.commit()
        exc = next(failures)
        if exc is not None:
            raise exc
        return state.step

    result = run_fn(train, lambda: events.append("reset"))(state)
    # 1st call: step 1, uncommitted, internal error -> restored to 0.  2nd: step 1 again,
    # hosts removed (no restore, no sync).  3rd: step 2, committed, hosts added.  4th: synced
    # from the commit (2), step 3.
    assert result == 3
    assert events == ["sync", "reset", ("callback", 0), "sync", "reset", ("callback", 1),
                      "reset", ("callback", 2), "sync"]


# ---- sampler --------------------------------------------------------------------------------
def _sampler_at(dataset, world, rank, state_dict=None, epoch=None):
    """An ElasticSampler as rank ``rank`` of ``world`` sees it (a stand-in engine answers
    size() and rank() while it is set up)."""
    from aiak_training.runtime import current
    from aiak_training.torch.elastic import ElasticSampler

    class _Topology:
        def __init__(self, size, rank):
            self.size, self.rank = size, rank

    class _Engine:
        topology = _Topology(world, rank)
        running = True

    previous = current.install(_Engine())
    try:
        sampler = ElasticSampler(dataset, shuffle=True, seed=3)
        if epoch is not None:
            sampler.set_epoch(epoch)
        if state_dict is not None:
            sampler.load_state_dict(state_dict)
        return sampler
    finally:
        current.install(previous)


def test_elastic_sampler_resumes_epoch_without_repeats_or_skips():
    data = list(range(30))
    batch = 2
    ranks = [_sampler_at(data, 3, r, epoch=4) for r in range(3)]
    assert [len(s) for s in ranks] == [10, 10, 10]
    seen = []
    for b in range(2):  # two batches on 3 ranks, recorded
        for s in ranks:
            seen += s.get_indices(b, batch)
            s.record_batch(b, batch)
    # Reset to 2 ranks: the progress of all ranks is merged (what TorchState.sync does).
    merged = {"epoch": 4, "processed_indices": set().union(*(s.processed_indices
                                                               for s in ranks))}
    assert merged["processed_indices"] == set(seen) and len(seen) == 12
    new = [_sampler_at(data, 2, r, merged) for r in range(2)]
    rest = [i for s in new for i in iter(s)]
    assert sorted(seen + rest) == data  # 18 left, split 9 + 9: no repeat, no skip
    assert [len(s) for s in new] == [9, 9]
    assert set(new[0].indices).isdisjoint(new[1].indices)
    # The order is the epoch's seeded permutation of what is left, the same on every rank.
    order = [new[r].indices[k] for k in range(9) for r in range(2)]
    left = [i for i in data if i not in merged["processed_indices"]]
    g = torch.Generator()
    g.manual_seed(3 + 4)
    assert order == [left[i] for i in torch.randperm(len(left), generator=g).tolist()]


# ---- discovery and host logic ---------------------------------------------------------------
def test_discovery_output_parsing():
    assert parse_hosts_output("a:2\n\n# c\nb\n c:1 \n", "d.sh", slots_per_host=3) == {
        "a": 2, "b": 3, "c": 1}
    assert parse_hosts_output("10.0.0.1\n", "d.sh") == {"10.0.0.1": 1}
    with pytest.raises(DiscoveryError, match=r"d\.sh: line 2: 'b:x': slots must be"):
        parse_hosts_output("a:1\nb:x\n", "d.sh")
    with pytest.raises(DiscoveryError, match=r"line 1: 'no such host!'.*not a host name"):
        parse_hosts_output("no such host!\n", "d.sh")
    with pytest.raises(DiscoveryError, match="host a is listed twice"):
        parse_hosts_output("a:1\na:2\n", "d.sh")


def test_discovery_script_errors_name_the_script(tmp_path):
    missing = HostDiscoveryScript(str(tmp_path / "none.sh"))
    with pytest.raises(DiscoveryError, match="none.sh does not exist"):
        missing.find_available_hosts_and_slots()
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/bin/sh\necho a:1\n")
    with pytest.raises(DiscoveryError, match="plain.sh is not executable"):
        HostDiscoveryScript(str(plain)).find_available_hosts_and_slots()
    plain.chmod(0o755)
    assert HostDiscoveryScript(str(plain)).find_available_hosts_and_slots() == {"a": 1}
    failing = tmp_path / "failing.sh"
    failing.write_text("#!/bin/sh\necho 'cannot reach the API' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(DiscoveryError, match="failing.sh failed with exit code 3: cannot "
                                             "reach the API"):
        HostDiscoveryScript(str(failing)).find_available_hosts_and_slots()
    garbage = tmp_path / "garbage.sh"
    garbage.write_text("#!/bin/sh\necho a:1\necho '<html>'\n")
    garbage.chmod(0o755)
    with pytest.raises(DiscoveryError, match=r"garbage.sh: line 2: '<html>'"):
        HostDiscoveryScript(str(garbage)).find_available_hosts_and_slots()


def test_blacklist_cooldown():
    now = [100.0]
    plain = Blacklist(clock=lambda: now[0])
    assert plain.add("a") == float("inf")
    now[0] += 1e6
    assert "a" in plain
    import random
    cooling = Blacklist((10.0, 20.0), clock=lambda: now[0], rng=random.Random(1))
    first = cooling.add("b")
    assert 10.0 <= first <= 20.0 and "b" in cooling
    now[0] += first + 0.01
    assert "b" not in cooling  # back after the cool-down
    second = cooling.add("b")
    assert second == min(20.0, second) and second >= min(20.0, 2 * 10.0)  # doubled, capped


def test_plan_slots_and_rank_assignment():
    order = HostOrder()
    order.update(["b", "a"])
    order.update(["c", "a"])  # a new host goes last; known hosts keep their places
    assert list(order) == ["b", "a", "c"]
    slots = plan_slots(order, {"a": 2, "b": 1, "c": 2}, blocked={"b"}, max_np=3)
    assert slots == [("a", 0), ("a", 1), ("c", 0)]
    ids = assign_ranks([("a", 0), ("a", 1), ("c", 0), ("c", 1), ("d", 0)])
    assert ids[("a", 1)] == RankIdentity(1, 5, 1, 2, 0, 2, "a")
    assert ids[("c", 0)] == RankIdentity(2, 5, 0, 2, 1, 3, "c")
    assert ids[("d", 0)] == RankIdentity(4, 5, 0, 1, 2, 3, "d")


def test_elastic_flags_and_settings():
    args = parse_args(["-np", "2", "--min-num-proc", "2", "--max-num-proc", "4",
                       "--host-discovery-script", "d.sh", "--elastic-timeout", "5",
                       "--reset-limit", "3", "--blacklist-cooldown-range", "1", "2", "cmd"])
    assert elastic_requested(args)
    s = settings_from_args(args, {})
    assert (s.num_proc, s.min_np, s.max_np, s.elastic_timeout, s.reset_limit, s.cooldown) == (
        2, 2, 4, 5.0, 3, (1.0, 2.0))
    assert settings_from_args(parse_args(["--min-np", "1", "cmd"]),
                              {"HOROVOD_ELASTIC_TIMEOUT": "7"}).elastic_timeout == 7.0
    assert not elastic_requested(parse_args(["-np", "2", "cmd"]))
    for argv, message in ((["--min-np", "3", "--max-np", "2"], "--max-np 2 is smaller"),
                          (["--min-np", "x"], "--min-np: expected an integer"),
                          (["--min-np", "1", "--blacklist-cooldown-range", "5", "1"],
                           "the maximum 1 is smaller than the minimum 5")):
        with pytest.raises(ValueError, match=message):
            settings_from_args(parse_args(argv + ["cmd"]), {})


# ---- a real elastic job on virtual hosts (no root needed) ---------------------------------------
ELASTIC_ENV = {"STEP_SLEEP": "0.25", "COMMIT_EVERY": "2", "EPOCHS": "2"}


def test_host_killed_mid_epoch_continues_from_last_commit(tmp_path):
    # The program says `import horovod.torch as hvd`: an unmodified Elastic Horovod script.
    script, _ = discovery_script(tmp_path, ["hostA:1", "hostB:1", "hostC:1"])
    job = ElasticJob(["-np", "3", "--min-np", "2", "--horovod-compat", "--virtual-hosts",
                      "--host-discovery-script", script, sys.executable, SCRIPT], tmp_path,
                     {**ELASTIC_ENV, "ELASTIC_EXACT_HOROVOD": "1"})
    before = job.wait_steps(4)
    assert kill_host("hostC")
    code = job.finish()
    log = job.log()
    assert code == 0, log[-4000:]
    assert re.search(r"lost host hostC: worker \S+ \(host hostC slot 0, rank 2\) exited with "
                     r"signal SIGKILL", log), log[-4000:]
    out, history = exact_result(job)
    sizes = [h[1] for h in history]
    # Every committed step is kept (the history is part of the committed state): 3 ranks up to
    # at least the commit seen before the kill, 2 ranks after, and nothing else.
    first_two = sizes.index(2)
    assert first_two >= before and set(sizes[:first_two]) == {3} and set(sizes[first_two:]) == {2}
    assert out["size"] == 2
    check_exact(history, out["params"], int(ELASTIC_ENV["EPOCHS"]))
