"""Keep the two pages that exist twice in step: the README is the site's home page, and the
site's Benchmarks page is ``benchmarks/RESULTS.md``.

    python tools/sync_docs.py           # write docs/index.md and benchmarks/RESULTS.md
    python tools/sync_docs.py --check   # exit 1 if either is out of date (tests/test_docs.py)

Edit ``README.md`` and ``docs/benchmarks/index.md``; the copies only get their links rewritten
for where they live.
"""
import argparse
import os
import re
import sys
from typing import Callable, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_to_index(text: str) -> str:
    """README.md (links relative to the repository root) -> docs/index.md."""
    fixed = [
        ("Documentation: [`docs/`](docs/index.md) (build the site with `mkdocs serve`, after\n"
         "installing the `docs` extra).",
         "This is the documentation site; `mkdocs serve` in a checkout (with the `docs` extra\n"
         "installed) serves it locally."),
        ("[benchmarks/RESULTS.md](benchmarks/RESULTS.md) (the site's "
         "[Benchmarks](docs/benchmarks/index.md) page)",
         "[Benchmarks](benchmarks/index.md) (`benchmarks/RESULTS.md` in the repository)"),
        ("API reference (`docs/api/`, rendered by the site)", "[API reference](api/torch.md)"),
        ("[LICENSE](LICENSE) and [NOTICE](NOTICE)", "`LICENSE` and `NOTICE`"),
    ]
    for old, new in fixed:
        if old not in text:
            raise SystemExit(f"tools/sync_docs.py: README.md no longer contains {old!r}; "
                             "update readme_to_index")
        text = text.replace(old, new)
    text = text.replace("](docs/", "](")
    return ("<!-- Generated from README.md by tools/sync_docs.py: edit README.md. -->\n\n"
            + text)


def results_to_repo(text: str) -> str:
    """docs/benchmarks/index.md (links relative to docs/benchmarks/) -> benchmarks/RESULTS.md."""
    text = text.replace("](../img/", "](../docs/img/")
    text = re.sub(r"\]\(\.\./([\w./-]+\.md)", r"](../docs/\1", text)
    text = re.sub(r"\]\((history\.md)", r"](../docs/benchmarks/\1", text)
    return ("<!-- Generated from docs/benchmarks/index.md by tools/sync_docs.py: edit that "
            "file. -->\n\n" + text)


PAIRS: List[Tuple[str, str, Callable[[str], str]]] = [
    ("README.md", "docs/index.md", readme_to_index),
    ("docs/benchmarks/index.md", "benchmarks/RESULTS.md", results_to_repo),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only report stale copies")
    args = p.parse_args(argv)
    stale = []
    for src, dst, convert in PAIRS:
        with open(os.path.join(REPO, src)) as f:
            want = convert(f.read())
        path = os.path.join(REPO, dst)
        have = open(path).read() if os.path.exists(path) else None
        if have == want:
            continue
        if args.check:
            stale.append(f"{dst} is out of date with {src}: run python tools/sync_docs.py")
        else:
            with open(path, "w") as f:
                f.write(want)
            print(f"wrote {dst}")
    for line in stale:
        print(line, file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
