"""Autotune (aiak_training/runtime/autotune/, ``aiakrun --autotune``): options and flags, the
search, the CSV log, and real multi-rank runs of tests/scripts/autotune_job.py that check
every rank switches at the same step, fixed knobs stay, results stay exact and a short job
is reported."""
import csv
import json
import re
import sys

import pytest

from aiak_training.runner.cli.args import parse_args
from aiak_training.runner.cli.env_map import flag_env
from aiak_training.runtime.autotune.csvlog import HEADER, CsvLog
from aiak_training.runtime.autotune.knobs import MB, Setting, fixed_knobs, search_axes
from aiak_training.runtime.autotune.options import AutotuneOptions
from aiak_training.runtime.autotune.search import CoordinateSearch
from launch import run_ranks

JOB = [sys.executable, "tests/scripts/autotune_job.py"]
START = Setting(128 * MB, 1.0, "hier_pipelined", True)
ALL_ALGOS = ["flat", "hier_staged", "hier_pipelined"]


# ---- options and flags ------------------------------------------------------------------------
def test_options_defaults_are_horovods():
    assert AutotuneOptions.from_env({}) == AutotuneOptions(False, None, 3, 10, 20, 0.8)
    opts = AutotuneOptions.from_env({
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "t.csv",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "7",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.2"})
    assert opts == AutotuneOptions(True, "t.csv", 0, 4, 7, 0.2)


@pytest.mark.parametrize("name,value", [("HOROVOD_AUTOTUNE", "maybe"),
                                        ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "0"),
                                        ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "x"),
                                        ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "-1")])
def test_bad_option_names_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        AutotuneOptions.from_env({name: value})


def test_flags_set_horovods_variables():
    args = parse_args(["-np", "2", "--autotune", "--autotune-log-file", "a.csv",
                       "--autotune-warmup-samples", "0", "--autotune-steps-per-sample", "5",
                       "--autotune-bayes-opt-max-samples", "9",
                       "--autotune-gaussian-process-noise", "0.5", "python", "t.py"])
    env = {k: v for k, v in flag_env(args, {}).items() if k.startswith("HOROVOD_AUTOTUNE")}
    assert env == {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "a.csv",
                   "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
                   "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "5",
                   "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "9",
                   "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"}
    assert args.command == ["python", "t.py"]
    off = flag_env(parse_args(["-np", "2", "--no-autotune", "cmd"]), {})
    assert off["HOROVOD_AUTOTUNE"] == "0"
    # Not given: nothing set, so a value exported in the shell reaches the ranks.
    assert not [k for k in flag_env(parse_args(["-np", "2", "cmd"]), {}) if "AUTOTUNE" in k]


@pytest.mark.parametrize("flag,value", [("--autotune-steps-per-sample", "0"),
                                        ("--autotune-warmup-samples", "-1"),
                                        ("--autotune-bayes-opt-max-samples", "0")])
def test_bad_flag_value_is_rejected(flag, value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["-np", "2", flag, value, "cmd"])
    assert flag in capsys.readouterr().err


# ---- what is tuned ------------------------------------------------------------------------------
def test_fixed_knobs_come_from_their_variables():
    assert fixed_knobs({}) == []
    assert fixed_knobs({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": " "}) == \
        ["fusion_threshold"]
    assert fixed_knobs({"HOROVOD_CYCLE_TIME": "3", "HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}) == \
        ["cycle_time_ms", "algorithm"]
    assert fixed_knobs({"AIAK_ALLREDUCE_ALGO": "flat"}) == ["algorithm"]
    assert fixed_knobs({"HOROVOD_CACHE_CAPACITY": "0"}) == ["cache_enabled"]


def test_axes_start_from_the_jobs_setting_and_reach_the_default():
    axes = dict(search_axes(START, [], ALL_ALGOS))
    assert axes["fusion_threshold"][0] == 128 * MB
    assert set(axes["fusion_threshold"]) == {mb * MB for mb in (1, 4, 16, 32, 64, 128)}
    assert axes["cycle_time_ms"] == (1.0, 2.5, 5.0, 10.0, 25.0)
    assert axes["algorithm"] == ("hier_pipelined", "flat", "hier_staged")
    assert axes["cache_enabled"] == (True, False)
    # HOROVOD_CACHE_CAPACITY fixes it; a job that starts with the cache off (capacity 0)
    # cannot turn it on.
    assert "cache_enabled" not in dict(search_axes(START, ["cache_enabled"], ALL_ALGOS))
    off = Setting(128 * MB, 1.0, "flat", False)
    assert "cache_enabled" not in dict(search_axes(off, [], ["flat"]))
    odd = Setting(3 * MB, 7.0, "flat", True)
    axes = dict(search_axes(odd, ["cycle_time_ms", "cache_enabled"], ["flat"]))
    assert list(axes) == ["fusion_threshold"] and axes["fusion_threshold"][0] == 3 * MB
    assert search_axes(START, ["fusion_threshold", "cycle_time_ms", "cache_enabled"],
                       ["flat"]) == []


def _run_search(score, start=START, fixed=(), algos=ALL_ALGOS, max_samples=20):
    search = CoordinateSearch(start, search_axes(start, list(fixed), algos), max_samples)
    tried = []
    while not search.done:
        setting = search.next()
        tried.append(setting)
        search.record(setting, score(setting))
    return search, tried


def _separable(s: Setting) -> float:
    # Best at 16 MB, 5 ms, hier_staged: each knob's own peak, as steps per second.
    fusion = {1: 1.0, 4: 2.0, 16: 4.0, 32: 3.0, 64: 2.5, 128: 2.0}[s.fusion_threshold // MB]
    cycle = {1.0: 1.0, 2.5: 1.5, 5.0: 2.0, 10.0: 1.2, 25.0: 0.5}[s.cycle_time_ms]
    algo = {"flat": 1.0, "hier_staged": 3.0, "hier_pipelined": 2.0}[s.algorithm]
    return fusion + cycle + algo


def test_search_finds_the_best_of_a_separable_score_in_its_planned_samples():
    search, tried = _run_search(_separable)
    assert search.best == Setting(16 * MB, 5.0, "hier_staged", True)
    assert tried[0] == START                     # the job's own setting is measured first
    # 6 fusion + 4 more cycle times + cache off + 2 more algorithms, then the job's setting
    # and the 3 best others once more (the cache does not change this score: its two
    # settings tie, and the first measured leads).
    assert len(tried) == search.samples == search.planned == 17
    assert tried[10] == Setting(16 * MB, 5.0, "hier_pipelined", False)
    assert tried[13] == START and tried[14:] == [
        Setting(16 * MB, 5.0, "hier_staged", True), Setting(16 * MB, 5.0, "hier_pipelined", True),
        Setting(16 * MB, 5.0, "hier_pipelined", False)]
    assert len(set(tried)) == 13
    # Default settings: 3 warm-up samples and these, 10 steps each, within 300 steps.
    defaults = AutotuneOptions()
    assert (defaults.warmup_samples + search.planned) * defaults.steps_per_sample + 1 <= 300


def test_search_switches_the_cache_off_when_that_is_faster():
    def score(s):
        return _separable(s) + (0.0 if s.cache_enabled else 0.5)

    search, tried = _run_search(score)
    assert search.best == Setting(16 * MB, 5.0, "hier_staged", False)
    # the algorithm axis starts from the best so far, the cache already off
    assert tried[11:13] == [Setting(16 * MB, 5.0, "flat", False),
                            Setting(16 * MB, 5.0, "hier_staged", False)]


def test_one_lucky_sample_does_not_pick_the_setting():
    lucky = Setting(4 * MB, 1.0, "hier_pipelined", True)
    seen = {}

    def score(s):
        seen[s] = seen.get(s, 0) + 1
        if s == lucky:
            return 10.0 if seen[s] == 1 else 1.0   # fast once, slow when measured again
        return _separable(s)

    search, _ = _run_search(score)
    # The lucky sample steers the later axes, but the confirmation round measures it again
    # and picks the runner-up of the fusion axis instead.
    assert search.best == Setting(16 * MB, 1.0, "hier_pipelined", True)


@pytest.mark.parametrize("gain,keeps_start", [(1.04, True), (1.08, False)])
def test_the_jobs_setting_stays_unless_clearly_beaten(gain, keeps_start):
    better = Setting(32 * MB, 1.0, "hier_pipelined", True)

    def score(s):
        return 100.0 * gain if s == better else (100.0 if s == START else 50.0)

    search, _ = _run_search(score)
    assert search.best == (START if keeps_start else better)
    assert search.kept_start is keeps_start


@pytest.mark.parametrize("setting", [Setting(32 * MB, 2.5, "hier_staged", False),
                                     Setting(128 * MB, 1.0, "flat", True),
                                     Setting(3 * MB // 2, 10.0, "hier_pipelined", True)])
def test_printed_flags_and_variables_reproduce_the_setting(setting):
    """What autotune prints at the end, given back to aiakrun, fixes every knob it tuned."""
    args = parse_args(["-np", "2"] + setting.launcher_flags().split() + ["python", "t.py"])
    from_flags = flag_env(args, {})
    printed = dict(a.split("=", 1) for a in setting.environment().split())
    assert printed["HOROVOD_FUSION_THRESHOLD"] == str(setting.fusion_threshold)
    assert float(printed["HOROVOD_CYCLE_TIME"]) == setting.cycle_time_ms
    assert printed["AIAK_ALLREDUCE_ALGO"] == setting.algorithm
    assert printed.get("HOROVOD_CACHE_CAPACITY") == (None if setting.cache_enabled else "0")
    # The flags set the same variables (a fusion threshold that is not whole MiB is only
    # expressible as the variable); either way the knobs count as fixed.
    shared = {k: v for k, v in printed.items()
              if k != "HOROVOD_FUSION_THRESHOLD" or setting.fusion_threshold % MB == 0}
    def same_numbers(env):
        return {k: float(v) if k == "HOROVOD_CYCLE_TIME" else v for k, v in env.items()}
    assert same_numbers({k: from_flags[k] for k in shared}) == same_numbers(shared)
    assert set(fixed_knobs(printed)) == {"fusion_threshold", "cycle_time_ms", "algorithm"} | (
        set() if setting.cache_enabled else {"cache_enabled"})


def test_a_challenger_must_also_win_its_confirmation_sample():
    better = Setting(32 * MB, 1.0, "hier_pipelined", True)
    seen = {}

    def score(s):
        seen[s] = seen.get(s, 0) + 1
        if s == better:   # far ahead at first, then behind the job's setting when confirmed
            return 150.0 if seen[s] == 1 else 90.0
        return 100.0 if s == START else 50.0

    search, _ = _run_search(score)
    assert search.score(better) > search.score(START) * 1.05 and search.best == START


def test_max_samples_bounds_the_search():
    search, tried = _run_search(_separable, max_samples=5)
    assert len(tried) == 5 and search.done
    assert search.best == Setting(16 * MB, 1.0, "hier_pipelined", True)


def test_csv_log_has_horovods_columns(tmp_path):
    path = str(tmp_path / "log.csv")
    log = CsvLog(path)
    log.row(Setting(64 * MB, 2.5, "flat", True), 12.5)
    log.row(Setting(MB // 2, 5.0, "hier_staged", False), 3.25)
    log.close()
    with open(path) as fh:
        lines = fh.read().splitlines()
    assert lines == [",".join(HEADER), "0,0,0,1,2.5,64,12.5,flat",
                     "1,0,0,0,5,0.5,3.25,hier_staged"]
    assert HEADER[:7] == ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce",
                          "cache_enabled", "cycle_time_ms", "tensor_fusion_threshold", "score")


# ---- real runs --------------------------------------------------------------------------------
def _env(tmp_path, **extra):
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(tmp_path / "log.csv"),
           "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2"}
    env.update(extra)
    return env


def _records(tmp_path, nranks):
    runs = []
    for rank in range(nranks):
        with open(tmp_path / f"rank{rank}.json") as fh:
            runs.append(json.load(fh)["records"])
    return runs


def _log_rows(tmp_path):
    with open(tmp_path / "log.csv") as fh:
        rows = list(csv.reader(fh))
    assert tuple(rows[0]) == HEADER, rows[0]
    return rows[1:]


def _check_run(proc, tmp_path, nranks, steps):
    """Every rank exact and its per-step settings identical to rank 0's; tuning ended at one
    step on all, after which the setting never changes and equals the log's last row.
    Returns (rank 0's records, the log's rows, the step at which tuning ended)."""
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert len(re.findall(r"rank \d: \d+ steps exact", proc.stdout)) == nranks, proc.stdout
    runs = _records(tmp_path, nranks)
    assert all(len(r) == steps for r in runs)
    # The settings must match; the cache's entry count is the engine thread's state when the
    # step returned (a rank may complete a step before its cache has recorded it).
    def settings(run):
        return [{k: v for k, v in r.items() if k != "cache_entries"} for r in run]
    for rank, run in enumerate(runs[1:], start=1):
        assert settings(run) == settings(runs[0]), f"rank {rank} differs from rank 0"
    first = runs[0]
    ended = next(i for i, r in enumerate(first) if not r["tuning"])
    assert all(not r["tuning"] for r in first[ended:])
    # The engine's hot path leaves the tuner when tuning ends: the call that ended it (the
    # first submission of step ``ended``) was the last.
    calls = [r["tuner_calls"] for r in first]
    assert calls[ended] == calls[ended - 1] + 1, calls
    assert calls[ended:] == [calls[ended]] * (steps - ended), calls
    def setting(r):
        return {k: v for k, v in r.items() if k not in ("tuning", "tuner_calls")}
    final = setting(first[ended])
    assert all(setting(r) == final for r in first[ended:])
    rows = _log_rows(tmp_path)
    best = rows[-1]
    assert best[:6] == [str(int(final["algorithm"] != "flat")), "0", "0",
                        str(int(final["cache_enabled"])), f"{final['cycle_time_ms']:g}",
                        f"{final['fusion_threshold'] / MB:g}"] and best[7] == final["algorithm"]
    chosen = re.findall(r"autotune: chose (.*)", proc.stdout)
    assert len(chosen) == 1, proc.stdout                # rank 0 only, once
    again = re.findall(r"add to the aiakrun command \(without --autotune\): (.*); or set on every "
                       r"rank: (.*)", proc.stdout)
    final_setting = Setting(final["fusion_threshold"], final["cycle_time_ms"],
                            final["algorithm"], final["cache_enabled"])
    assert again == [(final_setting.launcher_flags(), final_setting.environment())], proc.stdout
    assert chosen[0].startswith(f"fusion threshold {final['fusion_threshold'] / MB:g} MB, "
                                f"cycle time {final['cycle_time_ms']:g} ms, "
                                f"allreduce {final['algorithm']}")
    return first, rows, ended


def _distinct(records, key):
    return list(dict.fromkeys(r[key] for r in records))


def _check_cache_switch(records, rows, ended):
    """Every sample of the log with the cache off is two steps (a sample) of records with it
    off, at the same steps on every rank (the records are equal across ranks), and the
    engine's cache was really empty then and in use otherwise."""
    off_rows = sum(r[3] == "0" for r in rows[:-1])
    off = [i for i, r in enumerate(records[:ended]) if not r["cache_enabled"]]
    assert off_rows >= 1 and len(off) == 2 * off_rows, (off, rows)
    assert all(off[k + 1] == off[k] + 1 for k in range(0, len(off), 2)), off
    for i, r in enumerate(records):
        if not r["cache_enabled"]:
            assert r["cache_entries"] == 0, (i, r)
        elif i > 0 and records[i - 1]["cache_enabled"]:  # on for a whole step already
            assert r["cache_entries"] > 0, (i, r)


def test_two_ranks_tune_and_switch_at_the_same_step(tmp_path):
    steps = 60
    proc = run_ranks([2], JOB + [str(tmp_path), str(steps)], env=_env(tmp_path), timeout=300)
    first, rows, ended = _check_run(proc, tmp_path, 2, steps)
    # One node: fusion (6 values), cycle time (4 more), the cache off (1), 4 confirmations,
    # the best last.
    assert len(rows) == 6 + 4 + 1 + 4 + 1
    assert {float(r[5]) for r in rows[:6]} == {1, 4, 16, 32, 64, 128}
    assert {float(r[4]) for r in rows[6:10]} == {2.5, 5, 10, 25}
    assert [r[3] for r in rows[:11]] == ["1"] * 10 + ["0"]
    assert all(r[7] == "flat" and r[0] == "0" for r in rows)
    # Switched at steps: the records show each setting the log tried.
    assert len(_distinct(first, "fusion_threshold")) >= 6
    assert len(_distinct(first, "cycle_time_ms")) >= 4
    _check_cache_switch(first, rows, ended)
    # Marker step, 1 warm-up and 15 samples of 2 steps.
    assert ended == 1 + 2 * (1 + 15)
    assert f"tuning took {ended} steps" in proc.stdout


def test_fixed_knob_is_left_alone(tmp_path):
    steps = 30
    env = _env(tmp_path, HOROVOD_FUSION_THRESHOLD=str(2 * MB), HOROVOD_CACHE_CAPACITY="1024")
    proc = run_ranks([2], JOB + [str(tmp_path), str(steps)], env=env, timeout=300)
    first, rows, _ = _check_run(proc, tmp_path, 2, steps)
    assert {r["fusion_threshold"] for r in first} == {2 * MB}
    assert {r[5] for r in rows} == {"2"}
    assert {float(r[4]) for r in rows} == {1, 2.5, 5, 10, 25}   # only the cycle time moves
    assert {r[3] for r in rows} == {"1"} and all(r["cache_enabled"] for r in first)


def test_algorithm_is_tuned_on_two_virtual_nodes(tmp_path):
    steps = 30
    env = _env(tmp_path, HOROVOD_FUSION_THRESHOLD=str(MB), HOROVOD_CYCLE_TIME="1",
               HOROVOD_CACHE_CAPACITY="1024")
    proc = run_ranks([2, 2], JOB + [str(tmp_path), str(steps)], env=env,
                     virtual_hosts=True, timeout=300)
    first, rows, ended = _check_run(proc, tmp_path, 4, steps)
    assert [r[7] for r in rows[:3]] == ["hier_pipelined", "flat", "hier_staged"]
    assert [r[0] for r in rows[:3]] == ["1", "0", "1"]
    assert len(rows) == 3 + 3 + 1          # 3 algorithms, all 3 confirmed, the best
    assert _distinct(first[:ended], "algorithm")[:3] == ["hier_pipelined", "flat",
                                                          "hier_staged"]


def test_default_settings_finish_within_300_steps(tmp_path):
    steps = 200
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(tmp_path / "log.csv")}
    proc = run_ranks([2], JOB + [str(tmp_path), str(steps)], env=env, timeout=400)
    _, rows, ended = _check_run(proc, tmp_path, 2, steps)
    assert ended == 1 + 10 * (3 + 15) <= 300
    assert len(rows) == 16


def test_short_job_says_how_far_tuning_got(tmp_path):
    proc = run_ranks([2], JOB + [str(tmp_path), "7"],
                     env={"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(tmp_path / "l.csv")},
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    said = re.findall(r"autotune: the job ended after (\d+) steps, before tuning finished: "
                      r"still warming up \((\d) of 3 warm-up samples of 10 steps\)", proc.stdout)
    assert said == [("7", "0")], proc.stdout            # rank 0 only
    assert "autotune: chose" not in proc.stdout
    with open(tmp_path / "l.csv") as fh:
        assert fh.read().splitlines() == [",".join(HEADER)]
    # Past warm-up: the samples measured so far are in the log, the best so far last.
    proc = run_ranks([2], JOB + [str(tmp_path), "12"], env=_env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    said = re.findall(r"autotune: the job ended after 12 steps, before tuning finished: "
                      r"(\d+) of about 15 samples measured; best so far: ", proc.stdout)
    assert said == ["4"], proc.stdout
    assert len(_log_rows(tmp_path)) == 4 + 1


def test_aiakrun_autotune_flags_reach_the_ranks(tmp_path):
    steps = 40
    log = tmp_path / "log.csv"
    cmd = [sys.executable, "-m", "aiak_training.runner.launch", "-np", "2", "--autotune",
           "--autotune-log-file", str(log), "--autotune-warmup-samples", "0",
           "--autotune-steps-per-sample", "2", "--autotune-bayes-opt-max-samples", "4"]
    proc = run_ranks([1], cmd + JOB + [str(tmp_path), str(steps)],
                     env={"HOROVOD_AUTOTUNE": "", "HOROVOD_AUTOTUNE_LOG": ""}, timeout=300)
    _, rows, ended = _check_run(proc, tmp_path, 2, steps)
    assert len(rows) == 4 + 1 and ended == 1 + 2 * 4     # no warm-up, 4 samples at most


def test_gloo_job_tunes_on_the_python_engine(tmp_path):
    steps = 40
    cmd = [sys.executable, "-m", "aiak_training.runner.launch", "--gloo", "-np", "2"]
    proc = run_ranks([1], cmd + JOB + [str(tmp_path), str(steps)], env=_env(tmp_path),
                     timeout=300)
    _, rows, _ = _check_run(proc, tmp_path, 2, steps)
    assert all(r[7] == "flat" for r in rows) and len(rows) == 16
