"""Rules the test suite keeps so that a broken build cannot pass as skipped tests.

* Every CPU extension that setup.py declares was built, and imports as a compiled module:
  the suites that skip without one (tests/test_fused_optim.py, DGC's native kernels, ...)
  are then never skipped silently.
* No test turns an exception into a skip: a ``try`` whose handler catches ``Exception``,
  ``BaseException`` or everything and calls ``pytest.skip``, and ``pytest.importorskip`` of a
  module of this project, are refused.
"""
import ast
import glob
import importlib
import importlib.machinery
import os
import re
from typing import Callable, List, Set

import pytest

from launch import REPO

BROAD = {"Exception", "BaseException"}


def declared_extensions() -> List[str]:
    """The module names setup.py builds with ``_extension("name", ...)``."""
    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
        return re.findall(r'_extension\("([\w.]+)"', f.read())


def test_setup_declares_the_cpu_extensions():
    assert set(declared_extensions()) >= {"aiak_training._native",
                                           "aiak_training.fused_optim._cpu",
                                           "aiak_training.dgc._dgc_cpu",
                                           "aiak_training.allreduce._adasum_cpu"}


@pytest.mark.parametrize("name", declared_extensions())
def test_cpu_extension_built_and_imports(name):
    module = importlib.import_module(name)
    assert module.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), \
        module.__file__


def _skips(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func).endswith("skip")
               for n in ast.walk(node))


def exception_skips(source: str) -> List[str]:
    """Where ``source`` turns an exception into a skip: 'line N: ...' for each place."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler) and _skips(node):
            caught = ast.unparse(node.type) if node.type else "everything"
            names = {part.strip("() ") for part in caught.split(",")}
            if caught == "everything" or names & BROAD:
                found.append(f"line {node.lineno}: except {caught} -> skip")
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("importorskip") \
                and node.args and isinstance(node.args[0], ast.Constant) \
                and str(node.args[0].value).startswith("aiak_training"):
            found.append(f"line {node.lineno}: importorskip({node.args[0].value!r})")
    return found


def docstring_ids(tree: ast.AST) -> Set[int]:
    """``id()`` of every docstring node in ``tree``: rules about code skip them."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def violations(folder: str, check: Callable[[str], List[str]]) -> List[str]:
    """``check``'s findings in every Python file under ``folder`` (relative to the repository),
    each prefixed with its file's path."""
    found = []
    for path in sorted(glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            found += [f"{os.path.relpath(path, REPO)} {where}" for where in check(f.read())]
    return found


def test_no_test_turns_an_exception_into_a_skip():
    found = violations("tests", exception_skips)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, caught", [
    ("try:\n    f()\nexcept Exception as e:\n    pytest.skip(str(e))\n", True),
    ("try:\n    f()\nexcept:\n    pytest.skip('x')\n", True),
    ("try:\n    f()\nexcept (ValueError, BaseException):\n    pytest.skip('x')\n", True),
    ("m = pytest.importorskip('aiak_training.fused_optim')\n", True),
    ("try:\n    f()\nexcept ImportError:\n    pytest.skip('x')\n", False),
    ("try:\n    f()\nexcept Exception:\n    raise\n", False),
    ("ray = pytest.importorskip('ray')\n", False),
])
def test_exception_skip_finder(source, caught):
    assert bool(exception_skips(source)) is caught
