"""The documentation site builds cleanly, and says what the code has.

* ``mkdocs build --strict`` passes: broken links and anchors, pages missing from the nav's
  targets, API objects mkdocstrings cannot find, and every other warning fail it.
* Every public name the API coverage tables of docs/horovod.md list has an entry in the
  rendered API reference of its module.
* The pages that exist twice (README.md and docs/index.md; docs/benchmarks/index.md and
  benchmarks/RESULTS.md) are in step, the README's test command is the one CI runs, and
  benchmarks/plots.py redraws every plot the pages show from the JSON in benchmarks/results/.

Needs the ``docs`` extra (``pip install -e '.[docs]'``); without it these tests skip and say so.
"""
import importlib.util
import os
import re
import subprocess
import sys
from typing import Dict, List

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")

_MISSING = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
            if importlib.util.find_spec(m.split(".")[0]) is None
            or (m == "mkdocstrings_handlers.python" and importlib.util.find_spec(m) is None)]
needs_mkdocs = pytest.mark.skipif(bool(_MISSING), reason="the docs extra is not installed "
                                  f"(missing {', '.join(_MISSING)}): pip install -e '.[docs]'")
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed: pip install -e '.[docs]'")

# Section heading of docs/horovod.md -> the API reference page of that module.
COVERAGE = {"aiak_training.torch": "api/torch", "aiak_training.tensorflow": "api/tensorflow",
            "aiak_training.keras": "api/keras"}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("site"))
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    # `mkdocs build --strict`, in a process that then reports whether building imported the
    # package: the reference is made by static analysis, so it must not need MPI.
    script = ("import sys\n"
              "from mkdocs.__main__ import cli\n"
              "try:\n"
              f"    cli(['build', '--strict', '-f', {os.path.join(REPO, 'mkdocs.yml')!r}, "
              f"'-d', {out!r}])\n"
              "except SystemExit as e:\n"
              "    code = e.code\n"
              "imported = sorted(m for m in sys.modules if m.split('.')[0] in "
              "('aiak_training', 'mpi4py', 'torch', 'tensorflow'))\n"
              "print('IMPORTED', imported[:5])\n"
              "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    assert "IMPORTED []" in proc.stdout, f"building the docs imported modules: {proc.stdout}"
    return out


def coverage_names() -> Dict[str, List[str]]:
    """Module -> the names its API coverage table lists (first column, in backticks)."""
    with open(os.path.join(DOCS, "horovod.md")) as f:
        text = f.read()
    names: Dict[str, List[str]] = {}
    module = None
    for line in text.splitlines():
        heading = re.match(r"^###\s+`([\w.]+)`\s*$", line)
        if heading:
            module = heading.group(1) if heading.group(1) in COVERAGE else None
            continue
        if line.startswith("## "):
            module = None
        if module is None or not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        for token in re.findall(r"`([A-Za-z_][\w.]*)`", first_cell):
            # "Compression.fp16" is documented under "Compression".
            names.setdefault(module, []).append(token.split(".")[0])
    return names


def test_coverage_tables_are_parsed():
    names = coverage_names()
    assert set(names) == set(COVERAGE), names.keys()
    # The torch table alone lists the whole horovod.torch surface.
    for expected in ("init", "allreduce_async_", "DistributedOptimizer", "SyncBatchNorm",
                     "broadcast_optimizer_state", "HorovodInternalError"):
        assert expected in names["aiak_training.torch"]
    assert "DistributedGradientTape" in names["aiak_training.tensorflow"]
    assert "callbacks" in names["aiak_training.keras"]
    assert sum(len(v) for v in names.values()) > 120


@needs_mkdocs
def test_mkdocs_build_strict(site):
    for page in ("index.html", "getting-started/index.html", "horovod/index.html",
                 "hierarchical-allreduce/index.html", "benchmarks/index.html",
                 "api/torch/index.html"):
        assert os.path.exists(os.path.join(site, page)), page


@needs_mkdocs
def test_every_covered_name_has_a_reference_entry(site):
    missing = []
    for module, names in coverage_names().items():
        with open(os.path.join(site, COVERAGE[module], "index.html")) as f:
            html = f.read()
        anchors = set(re.findall(r'id="(aiak_training[\w.]*)"', html))
        for name in names:
            if f"{module}.{name}" not in anchors:
                missing.append(f"{module}.{name}")
    assert not missing, f"listed in docs/horovod.md but not in the API reference: {missing}"


@needs_mkdocs
def test_reference_pages_render_every_module(site):
    for page, module, some_name in (("api/fused_optim", "aiak_training.fused_optim", "FusedAdam"),
                                    ("api/dgc", "aiak_training.dgc", "DGCCompressor"),
                                    ("api/allreduce", "aiak_training.allreduce",
                                     "select_algorithm"),
                                    ("api/cluster", "aiak_training.testing.cluster",
                                     "EmulatedCluster")):
        with open(os.path.join(site, page, "index.html")) as f:
            assert f'id="{module}.{some_name}"' in f.read(), (page, some_name)


def test_generated_pages_in_step():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "sync_docs.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _fenced_commands(path: str, after: str) -> str:
    with open(path) as f:
        text = f.read()
    block = text[text.index(after):]
    return re.search(r"```bash\n(.*?)\n```", block, re.S).group(1).strip()


def test_readme_test_command_is_what_ci_runs():
    command = _fenced_commands(os.path.join(REPO, "README.md"), "**Install and run the tests**")
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci_lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert command in ci_lines
    assert "docs" in command  # so CI installs what test_mkdocs_build_strict needs
    # The site's Getting started page gives the same two commands.
    getting_started = open(os.path.join(DOCS, "getting-started.md")).read()
    assert command in getting_started
    assert _fenced_commands(os.path.join(REPO, "README.md"),
                            "**Install and run the main job**") in getting_started


@needs_matplotlib
def test_plots_redraw_every_image_the_pages_show(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "plots.py"), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    drawn = {p for p in os.listdir(tmp_path) if os.path.getsize(tmp_path / p) > 1000}
    shown = set()
    for root, _, files in os.walk(DOCS):
        for name in files:
            if name.endswith(".md"):
                with open(os.path.join(root, name)) as f:
                    shown.update(re.findall(r"\]\((?:\.\./)*img/([\w.-]+\.png)\)", f.read()))
    assert shown, "no plot found in the pages"
    assert shown <= drawn, f"shown but not drawn by benchmarks/plots.py: {shown - drawn}"
    assert drawn <= set(os.listdir(os.path.join(DOCS, "img"))), "docs/img lacks a plot"


def test_repository_pages_link_to_files_that_exist():
    """README.md and benchmarks/RESULTS.md are read on the forge, outside the site: their
    relative links and images must point at files of the repository."""
    broken = []
    for page in ("README.md", os.path.join("benchmarks", "RESULTS.md")):
        base = os.path.dirname(os.path.join(REPO, page))
        with open(os.path.join(REPO, page)) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target) or target.startswith("#"):
                continue
            path = target.split("#")[0]
            if not os.path.exists(os.path.normpath(os.path.join(base, path))):
                broken.append(f"{page}: {target}")
    assert not broken, broken
    with open(os.path.join(REPO, "README.md")) as f:
        assert len(f.read().splitlines()) <= 200, "the README is a front page: keep it short"
