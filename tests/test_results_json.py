"""Every figure in the results page's target table is held by a JSON file under
benchmarks/results/ (tools/check_results.py), and the check itself fails where it should."""
import json
import os
import subprocess
import sys

import pytest

from launch import REPO

sys.path.insert(0, os.path.join(REPO, "tools"))
import check_results  # noqa: E402

HEADER = ("## Headline\n\n| key | measured | JSON |\n|---|---|---|\n")


def test_results_page_figures_are_in_their_json():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "check_results.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture
def results(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "run1.json").write_text(json.dumps(
        {"ratios": {"speedup": 1.2345}, "results": [{"median_s": 0.0321, "reps": 5}]}))
    return folder


def check(tmp_path, results, rows):
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n" + HEADER + "".join(f"| {r} |\n" for r in rows) + "\nafter\n")
    return check_results.check(str(page), str(results))


def test_figures_held_at_their_printed_precision(tmp_path, results):
    assert check(tmp_path, results, [
        "`speedup` | 1.23, 1.2 and 32.1 ms (11-27, issue 33, ResNet-50, 2x2) | `run1.json`",
        "not measured | |",
    ]) == []


@pytest.mark.parametrize("row, problem", [
    ("`speedup` | 1.24 | `run1.json`", "1.24 is in none of"),            # wrong figure
    ("`speedup` | 1.2345 and 32.1 | `run1.json`", "32.1 is in none of"),  # unit left out
    ("`speedup` | 1.23 | ", "1.23 has no JSON file"),                     # no file named
    ("`speedup` | 1.23 | `run2.json`", "no file matches run2.json"),      # missing file
    ("`speedup` | 1.23, then 7.0. | `run1.json`", "7.0 is in none of"),  # ends a sentence
])
def test_figures_not_held_fail(tmp_path, results, row, problem):
    problems = check(tmp_path, results, [row])
    assert any(problem in p for p in problems), problems
