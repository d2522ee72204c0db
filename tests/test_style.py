"""The house's shape, checked: ruff's rules (names, import blocks, the 120-column limit) over the
whole repository, and no class in stages/, lever/policy/ or lever/tree/ too big to read whole."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.conftest import ROOT

MAX_CLASS_LINES = 250
MAX_CLASS_METHODS = 20  # functions in the class body, properties and dunders included


def test_ruff_is_clean():
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def classes(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                yield path.relative_to(ROOT), node


@pytest.mark.parametrize("folder", ["stages", "lever/policy", "lever/tree"])
def test_no_class_is_too_big_to_read_whole(folder):
    found = list(classes(folder))
    assert found
    for path, c in found:
        n_lines = c.end_lineno - c.lineno + 1
        n_methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in c.body)
        assert n_lines <= MAX_CLASS_LINES and n_methods <= MAX_CLASS_METHODS, (str(path), c.name, n_lines, n_methods)
