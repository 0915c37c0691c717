"""Check that every figure in the results page's target table is held by a JSON file.

    python tools/check_results.py             # benchmarks/RESULTS.md against benchmarks/results/
    python tools/check_results.py PAGE DIR    # another page or folder (the tests use this)

The page's first table after its ``## Headline`` heading needs a ``measured`` column and a
``JSON`` column.  The JSON cell names files under DIR in backticks (glob patterns allowed).
Every number in the measured cell must equal, at the precision it is printed with, a number
somewhere in one of the row's files (any depth, lists included).  A unit after the number
lets the file hold it in base units: ``ms`` and ``us``/``µs`` may be seconds, ``MiB`` bytes,
``%`` a fraction.  Dates (``11-27``) and issue numbers (``issue 33``) are not figures.  So a figure with no file, a
file that does not exist, or a figure its files do not hold fails the check.

Exit status 0 when every figure is found, 1 otherwise (each problem on its own line).
"""
import argparse
import glob
import json
import os
import re
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, "benchmarks", "RESULTS.md")
RESULTS = os.path.join(REPO, "benchmarks", "results")

# A number not glued to a word, a dot or a hyphen ("ResNet-50", "2x2", "55c9e2d" are not
# figures), then an optional unit.  "1.03." at the end of a sentence is 1.03.
FIGURE = re.compile(r"(?<![\w.\-])(-?\d+(?:\.\d+)?)(?!\w|\.\d)(?:\s*(ms|us|µs|MiB|%|s)(?!\w))?")
# Dates ("11-27") and issue numbers ("issue 33") are references, not figures.
REFERENCE = re.compile(r"(?<![\w.\-])\d\d-\d\d(?![\w.\-])|\bissues? \d+")
# What a number in the file may be multiplied by to print as the figure, per unit.
SCALES = {"": (1.0,), "s": (1.0,), "ms": (1.0, 1e3), "us": (1.0, 1e6), "µs": (1.0, 1e6),
          "MiB": (1.0, 1.0 / (1 << 20)), "%": (1.0, 100.0)}


def figures(cell: str) -> List[Tuple[str, str]]:
    """(number as printed, unit) of every figure in a measured cell."""
    return FIGURE.findall(REFERENCE.sub(" ", cell))


def numbers_in(data: object) -> Iterator[float]:
    """Every number in a parsed JSON document (booleans are not numbers)."""
    if isinstance(data, dict):
        data = list(data.values())
    if isinstance(data, list):
        for item in data:
            yield from numbers_in(item)
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield float(data)


def holds(values: Sequence[float], printed: str, unit: str) -> bool:
    """Whether one of ``values``, scaled as ``unit`` allows, prints as ``printed``."""
    target = float(printed)
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    tolerance = 0.5 * 10 ** -decimals * (1 + 1e-9)
    return any(abs(v * scale - target) <= tolerance for v in values for scale in SCALES[unit])


def table_rows(text: str) -> List[Dict[str, str]]:
    """The rows of the first table after ``## Headline``, as {column: cell}."""
    after = text.split("\n## Headline", 1)
    if len(after) < 2:
        raise SystemExit("no '## Headline' section")
    lines = after[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    block = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])  # an escaped pipe stays in its cell
        block.append([cell.strip() for cell in cells])
    header = block[0]
    return [dict(zip(header, cells)) for cells in block[2:]]


def check(page: str, results: str) -> List[str]:
    """Every problem found, one message each; empty when every figure is held."""
    with open(page, encoding="utf-8") as f:
        rows = table_rows(f.read())
    problems = []
    for row in rows:
        if "measured" not in row or "JSON" not in row:
            return [f"{page}: the target table needs a 'measured' and a 'JSON' column"]
        label = f"{row.get('benchmark', '')} {row.get('key', '')}".strip()
        values: List[float] = []
        for pattern in re.findall(r"`([^`]+)`", row["JSON"]):
            found = sorted(glob.glob(os.path.join(results, pattern)))
            if not found:
                problems.append(f"{label}: no file matches {pattern}")
            for path in found:
                with open(path, encoding="utf-8") as f:
                    values.extend(numbers_in(json.load(f)))
        for printed, unit in figures(row["measured"]):
            if not values:
                problems.append(f"{label}: {printed}{unit} has no JSON file")
            elif not holds(values, printed, unit):
                problems.append(f"{label}: {printed}{unit} is in none of {row['JSON']}")
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("page", nargs="?", default=PAGE, help="results page (Markdown)")
    p.add_argument("results", nargs="?", default=RESULTS, help="folder of JSON files")
    args = p.parse_args(argv)
    problems = check(args.page, args.results)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
