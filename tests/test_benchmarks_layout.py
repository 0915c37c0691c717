"""Benchmarks stand on their own: no file under ``benchmarks/`` reaches into ``tests/``.

A benchmark gets its harness from ``benchmarks/bench_common.py`` and the per-rank programs it
shares with the tests from ``benchmarks/jobs/`` (the tests import those from there, never the
other way round).  So no benchmark file may

* import a module of ``tests/`` (``import tests...``, or a module that exists only there,
  such as ``test_gpu_executor`` or ``helpers``, found through a path it added), or
* name a ``tests`` directory in its code (``os.path.join(REPO, "tests", ...)``,
  ``"tests/scripts/x.py"``): a path put on ``sys.path`` or a program it runs.

Files are read with ``ast``; docstrings may still point a reader at a test.
"""
import ast
import glob
import os
from typing import List, Set

import pytest

from launch import JOBS, REPO
from test_suite_rules import docstring_ids, violations

BENCHMARKS = os.path.join(REPO, "benchmarks")


def _modules_in(folder: str) -> Set[str]:
    return {os.path.splitext(os.path.basename(p))[0]
            for p in glob.glob(os.path.join(folder, "**", "*.py"), recursive=True)}


def modules_only_in_tests() -> Set[str]:
    """Names a benchmark could import only by putting a folder of ``tests/`` on its path."""
    return _modules_in(os.path.join(REPO, "tests")) - _modules_in(BENCHMARKS)


def _names_tests_dir(text: str) -> bool:
    parts = text.replace("\\", "/").split("/")
    return "tests" in parts


def reaches_into_tests(source: str, tests_modules: Set[str]) -> List[str]:
    """Where ``source`` imports from ``tests/`` or names a ``tests`` directory in its code:
    'line N: ...' for each place."""
    tree = ast.parse(source)
    skip = docstring_ids(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            names = []
        for name in names:
            top = name.split(".")[0]
            if top == "tests" or top in tests_modules:
                found.append(f"line {node.lineno}: imports {name}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in skip and _names_tests_dir(node.value):
            found.append(f"line {node.lineno}: names a tests directory: {node.value!r}")
    return found


def benchmark_files() -> List[str]:
    return sorted(glob.glob(os.path.join(BENCHMARKS, "**", "*.py"), recursive=True))


def test_the_jobs_folder_is_where_tests_find_shared_programs():
    assert os.path.isdir(JOBS) and os.path.dirname(JOBS) == BENCHMARKS
    assert any(os.path.dirname(p) == JOBS for p in benchmark_files())


def test_no_benchmark_reaches_into_tests():
    tests_modules = modules_only_in_tests()
    found = violations("benchmarks", lambda source: reaches_into_tests(source, tests_modules))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, caught", [
    ('sys.path.insert(0, os.path.join(REPO, "tests", "scripts"))\n', True),
    ('sys.path.insert(0, os.path.join(HERE, "..", "tests"))\n', True),
    ('SCRIPT = "tests/scripts/deadlock.py"\n', True),
    ('SCRIPT = os.path.join(REPO, "tests/parallel/gpu_fakes.py")\n', True),
    ("import tests.launch\n", True),
    ("from tests.parallel import helpers\n", True),
    ("import test_gpu_executor as fake\n", True),
    ("from helpers import rank_data\n", True),
    ('"""Trains what tests/parallel/test_dgc_convergence.py trains."""\nimport os\n', False),
    ('def f():\n    """See tests/scripts/x.py."""\n    return 1\n', False),
    ('SCRIPT = os.path.join(HERE, "jobs", "deadlock.py")\n', False),
    ("import gpu_fakes\nfrom bench_common import run_jobs\n", False),
    ('HELP = "bus bandwidth, as nccl-tests reports it"\n', False),
])
def test_finder(source, caught):
    assert bool(reaches_into_tests(source, {"test_gpu_executor", "helpers", "launch"})) is caught
