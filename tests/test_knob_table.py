"""The knob table (aiak_training/common/tuning): it is the only list of knobs, their
variables, flags and algorithms, and every reader takes its values from it.

The scan reads every module of the package with ``ast`` and looks at its string literals
(f-strings' pieces included, docstrings left out): a module other than the table that spells
out a knob's variable, flag or script change, or lists two or more allreduce algorithms, fails
unless :data:`ALLOWED` names it with a reason.
"""
import ast
import os
import re
import sys
from typing import Dict, Set

import pytest

from aiak_training.common.tuning import (ALGORITHM_CHOICES, ALGORITHMS, ALLREDUCE_ALGORITHM,
                                         AT_START, AT_STEP, DGC, FUSED_OPTIMIZER, IN_SCRIPT,
                                         KNOBS, MB, OVERLAP_UPDATE, knob)

from test_suite_rules import docstring_ids

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "aiak_training")
TABLE = os.path.join("aiak_training", "common", "tuning", "table.py")

#: Modules that may still spell out a name of the table, and which names.
ALLOWED: Dict[str, Set[str]] = {
    # The advisor's formula per algorithm, keyed by the table's names (checked equal below).
    os.path.join("aiak_training", "advisor", "model.py"): {"algorithms"},
}


def _names() -> Set[str]:
    """Every variable, flag and script change of the table."""
    out: Set[str] = set()
    for row in KNOBS:
        out.update(row.env)
        out.update(x for x in (row.flag, row.script) if x)
    return out


def _is_algorithm(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in ALGORITHMS


def scan(source: str, names: Set[str]) -> Set[str]:
    """The names of ``names`` that ``source``'s string literals spell out, and
    ``"algorithms"`` when a tuple, list, set or dict of it holds two or more algorithms."""
    tree = ast.parse(source)
    skip = docstring_ids(tree)
    patterns = {n: re.compile(r"(?<![\w-])" + re.escape(n) + r"(?![\w-])") for n in names}
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found.update(n for n, p in patterns.items() if p.search(node.value))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            if sum(map(_is_algorithm, node.elts)) >= 2:
                found.add("algorithms")
        elif isinstance(node, ast.Dict):
            if sum(map(_is_algorithm, node.keys)) >= 2:
                found.add("algorithms")
    return found


def _package_hits() -> Dict[str, Set[str]]:
    names = _names()
    root = os.path.dirname(PACKAGE)
    hits: Dict[str, Set[str]] = {}
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)
            if rel == TABLE:
                continue
            with open(path) as fh:
                found = scan(fh.read(), names)
            if found:
                hits[rel] = found
    return hits


def test_the_table_is_the_only_list_of_knobs():
    hits = _package_hits()
    wrong = sorted(f"{path}: {sorted(found - ALLOWED.get(path, set()))}"
                   for path, found in hits.items() if found - ALLOWED.get(path, set()))
    assert not wrong, ("these modules spell out the knob table's names; take them from "
                       "aiak_training.common.tuning instead:\n" + "\n".join(wrong))
    # The allow-list stays short: an entry no longer needed goes.
    stale = sorted(f"{path}: {sorted(names - hits.get(path, set()))}"
                   for path, names in ALLOWED.items() if names - hits.get(path, set()))
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize("source, expected", [
    ('X = "HOROVOD_FUSION_THRESHOLD"\n', {"HOROVOD_FUSION_THRESHOLD"}),
    ('def f(a):\n    return f"--allreduce-algo {a}"\n', {"--allreduce-algo"}),
    ('MSG = "add --overlap-update, or --fused-optimizer."\n',
     {"--overlap-update", "--fused-optimizer"}),
    ('ALGOS = ["flat", "hier_staged"]\n', {"algorithms"}),
    ('F = {"hier_staged": 1, "hier_pipelined": 2}\n', {"algorithms"}),
    ('"""Docstrings may name HOROVOD_CYCLE_TIME."""\n# so may AIAK_ALLREDUCE_ALGO\n'
     'X = "HOROVOD_CYCLE_TIME_X"\nY = "flat"\n', set()),
])
def test_the_scan_finds_a_planted_name(source, expected):
    assert scan(source, _names()) == expected


def test_a_planted_module_fails_the_check(tmp_path, monkeypatch):
    # The whole check, on a copy of the package plus one module that lists knob variables.
    planted = tmp_path / "aiak_training" / "runtime" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text('VARS = ("HOROVOD_CYCLE_TIME", "AIAK_OVERLAP_UPDATE")\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(tmp_path / "aiak_training"))
    hits = _package_hits()
    assert hits == {os.path.join("aiak_training", "runtime", "planted.py"):
                    {"HOROVOD_CYCLE_TIME", "AIAK_OVERLAP_UPDATE"}}


def test_the_table_rows_are_complete():
    names = [row.name for row in KNOBS]
    assert len(set(names)) == len(names)
    assert all(knob(n).name == n for n in names)
    assert {"fusion_threshold", "cycle_time_ms", "cache_enabled", "algorithm", "overlap",
            "fused", "dgc"} <= set(names)
    for row in KNOBS:
        assert row.applied in (AT_START, AT_STEP, IN_SCRIPT), row
        assert row.autotune or row.advisor, row
        assert len(row.candidates) > 1, row
        if row.applied == IN_SCRIPT:
            assert row.script and row.flag is None and not row.env, row
        else:
            assert row.flag.startswith("--") and row.env, row
        # Autotune only varies what can switch while the job runs.
        assert not row.autotune or row.applied == AT_STEP, row
    assert ALLREDUCE_ALGORITHM.candidates is ALGORITHMS
    assert set(ALGORITHMS) <= set(ALGORITHM_CHOICES)


def test_the_readers_take_the_tables_values():
    from aiak_training import allreduce
    from aiak_training.advisor import model
    from aiak_training.common import config
    from aiak_training.runtime.autotune import knobs

    assert allreduce.ALGORITHMS is ALGORITHMS
    assert config.ALLREDUCE_ALGOS is ALGORITHM_CHOICES
    assert knobs.FIXING_VARS == {row.name: row.env for row in KNOBS if row.autotune}
    assert knobs.FUSION_MB == knob("fusion_threshold").candidates
    assert knobs.CYCLE_MS == knob("cycle_time_ms").candidates
    assert knobs.MB == MB
    # The advisor has a formula for every algorithm of the table, and no other, and its rows
    # cover the values of the knobs it varies.
    assert tuple(model.ALGORITHMS) == ALGORITHMS
    rows = model.configurations(model.Cluster(2, 2, model.Link(1e9, 0), model.Link(1e10, 0),
                                              1e10), fused_available=True)
    assert {r.algo for r in rows if not r.dgc} == set(ALGORITHMS)
    assert any(r.dgc for r in rows)
    best = model.Config("hier_staged", overlap=True, fused=True)
    assert best.flags == (f"{ALLREDUCE_ALGORITHM.flag} hier_staged {OVERLAP_UPDATE.flag} "
                          f"{FUSED_OPTIMIZER.flag}")
    assert model.Config(dgc=True).flags == DGC.script


@pytest.mark.parametrize("row", [r for r in KNOBS if r.flag], ids=lambda r: r.name)
def test_each_flag_sets_its_variable(row):
    from aiak_training.runner.cli.args import parse_args
    from aiak_training.runner.cli.env_map import flag_env

    value = {"fusion_threshold": ["2"], "cycle_time_ms": ["2.5"], "cache_enabled": ["0"],
             "algorithm": ["flat"]}.get(row.name, [])
    args = parse_args(["-np", "2", row.flag] + value + ["python", "t.py"])
    assert row.variable in flag_env(args, {})
