"""The package's import structure: layers import only downwards, and nothing imports in a
circle.  And its size: no folder holds more modules, and no module more lines, than a reader
can take in (:data:`MAX_MODULES_PER_FOLDER`, :data:`MAX_MODULE_LINES`).

Every ``import`` statement counts, including those inside functions and under
``TYPE_CHECKING``: a lazy import is still a dependency.  Modules are read with ``ast``, so
optional frameworks need not be installed.  Every package has a row in :data:`ALLOWED`
(the root package's row is ``""``); a new package without one fails.
"""
import ast
import os
import re
from typing import Dict, List, Set

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "aiak_training")
# The Horovod shim is a separate top-level package (``horovod``) put on the path on request.
SKIP_DIRS = {"__pycache__", "horovod_shim"}

# What each package may import from the others (its own modules are always allowed).
ALLOWED: Dict[str, Set[str]] = {
    # The engine's compiled kernels: a leaf that only common.native loads.
    "_native": set(),
    "common": {"_native"},
    "allreduce": {"common"},
    "runtime": {"common", "allreduce"},
    "fused_optim": {"common"},
    # Elastic training's framework-independent core (state, run loop, worker side).
    "elastic": {"common", "runtime"},
    "torch": {"common", "runtime", "fused_optim", "elastic"},
    "tensorflow": {"common", "runtime", "elastic"},
    "dgc": {"common", "runtime", "torch"},
    # Keras 3 on either backend: an adapter over each framework's frontend.
    "keras": {"common", "runtime", "tensorflow", "torch", "elastic"},
    # horovod.tensorflow.keras's name for aiak_training.keras: a facade above both.
    "tensorflow.keras": {"keras"},
    # Lightning 2's strategy over the torch frontend.
    "lightning": {"common", "runtime", "torch"},
    # The package root (aiak_training/__init__.py): the bounded exit of common/job/exit_guard.
    "": {"common"},
    # ``aiakrun --horovod-compat``'s import shim (a separate ``horovod`` tree, not read here)
    # and its switches.
    "compat": {"common"},
    # ``aiakrun --advise``: the probe and the trace run real torch steps (fused optimizers
    # included), so the advisor sits above the torch frontend.  Its rows' knobs and flags are
    # the knob table's (common/tuning).
    "advisor": {"common", "torch", "fused_optim"},
    # aiakrun, the top of the stack: it starts ranks (the Gloo rendezvous store of
    # runtime/transport), installs the Horovod shim (compat), runs --advise (advisor) and the
    # elastic driver (elastic's protocol).  Nothing but Ray and Spark imports it.
    "runner": {"common", "runtime", "compat", "advisor", "elastic"},
    # Cluster frameworks that place the ranks themselves: they reuse the runner's cluster jobs
    # and elastic driver, and the elastic worker side.
    "ray": {"common", "elastic", "runner"},
    "spark": {"elastic", "runner"},
    # The emulated cluster: standard library and external tools only.
    "testing": set(),
}
# Subpackages that form a layer of their own rather than part of their parent's.
FACADES = {"tensorflow.keras"}

# A folder with more modules than this is split into subpackages by concept; every ``.py``
# file directly in the folder counts, ``__init__.py`` included.
MAX_MODULES_PER_FOLDER = 12
# A module longer than this is split along a seam of its own (C++ and CUDA, in csrc/, are
# not read here).
MAX_MODULE_LINES = 600


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _extensions() -> Set[str]:
    """Compiled extension modules named in setup.py: leaves of the graph (they import
    nothing of ours), not aliases of the package that holds them."""
    with open(os.path.join(os.path.dirname(ROOT), "setup.py")) as fh:
        return set(re.findall(r'_extension\("(aiak_training[\w.]*)"', fh.read()))


def _modules() -> Dict[str, str]:
    found = {name: "" for name in _extensions()}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for f in filenames:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                found[_module_name(path)] = path
    return found


def _imports(name: str, path: str, known: Set[str]) -> Set[str]:
    """Project modules that ``name`` imports (a ``from pkg import mod`` names the module)."""
    if not path:  # a compiled extension
        return set()
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            # A module's own parent packages are imported before it runs in any case, so
            # naming one (``from . import sibling``) adds no dependency.
            if target.startswith("aiak_training") and not (name + ".").startswith(target + "."):
                out.add(target)
    return out


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    if ".".join(parts[1:3]) in FACADES:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else ""


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component with more than one member (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_graph_reader_sees_lazy_and_relative_imports(tmp_path):
    # The reader must not miss the imports this test exists to catch.
    pkg = tmp_path / "aiak_training" / "x"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    import aiak_training.x.c\n")
    known = {"aiak_training.x", "aiak_training.x.a", "aiak_training.x.b", "aiak_training.x.c"}
    assert "aiak_training._native" in _extensions()
    assert _imports("aiak_training.x.a", str(pkg / "a.py"), known) == {
        "aiak_training.x.b", "aiak_training.x.c"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _wrong_imports(graph: Dict[str, Set[str]], package: str) -> List[str]:
    """The imports of ``package``'s modules that its row of :data:`ALLOWED` does not allow."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if _package(m) == package
                  for t in targets
                  if _package(t) not in ALLOWED[package] | {package, ""})


def test_layer_check_catches_an_upward_import():
    # The check must be able to fail: common importing the runner is the kind it exists for.
    graph = {"aiak_training.common.env": {"aiak_training.runner.launch"},
             "aiak_training.runner.launch": {"aiak_training.common.env"}}
    assert _wrong_imports(graph, "common") == [
        "aiak_training.common.env -> aiak_training.runner.launch"]
    assert _wrong_imports(graph, "runner") == []


def test_every_package_has_a_row():
    missing = sorted({_package(m) for m in _graph()} - set(ALLOWED))
    assert not missing, f"packages with no row in ALLOWED (unchecked): {missing}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_their_layer(package):
    wrong = _wrong_imports(_graph(), package)
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_between_packages():
    graph = _graph()
    packages: Dict[str, Set[str]] = {}
    for m, targets in graph.items():
        packages.setdefault(_package(m), set()).update(
            _package(t) for t in targets if _package(t) != _package(m))
    assert _cycles(packages) == []


def test_no_import_cycles_between_modules():
    assert _cycles(_graph()) == []


def _folders() -> Dict[str, List[str]]:
    """Every folder of the package (the Horovod shim's included) -> its ``.py`` files."""
    out: Dict[str, List[str]] = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        out[dirpath] = sorted(f for f in filenames if f.endswith(".py"))
    return out


def test_no_folder_holds_more_than_a_dozen_modules():
    crowded = sorted(f"{os.path.relpath(d, os.path.dirname(ROOT))}: {len(files)} modules"
                     for d, files in _folders().items() if len(files) > MAX_MODULES_PER_FOLDER)
    assert not crowded, "\n".join(crowded)


def test_no_module_is_longer_than_600_lines():
    long = []
    for folder, files in _folders().items():
        for f in files:
            path = os.path.join(folder, f)
            with open(path) as fh:
                lines = sum(1 for _ in fh)
            if lines > MAX_MODULE_LINES:
                long.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}: {lines} lines")
    assert not long, "\n".join(sorted(long))
