"""The house's shape, checked: ruff's rules (names, import blocks, the 120-column limit) over the
whole repository; in every Python folder, no class too big to read whole (lines, methods, fields),
no function longer than a screen, no call passing more than seven arguments by place; the tree
cycle's tests drive it through its public face alone."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

FOLDERS = ("lever", "stages", "backends", "examples", "tests")
MAX_CLASS_LINES = 250
MAX_CLASS_METHODS = 20  # functions in the class body, properties and dunders included
MAX_CLASS_FIELDS = 20  # annotated names in the class body: attrs fields, protocol members
MAX_FUNCTION_LINES = 60
MAX_POSITIONAL = 7
# Foreign functions (ctypes) take no keywords: their calls mirror the C prototype in native/.
FOREIGN = ("_lib.",)


def test_ruff_is_clean():
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


@functools.cache
def modules(folder: str) -> tuple[tuple[Path, ast.Module], ...]:
    return tuple((path.relative_to(ROOT), ast.parse(path.read_text()))
                 for path in sorted((ROOT / folder).rglob("*.py")) if "build" not in path.parts)


def nodes(mods, kinds):
    for path, tree in mods:
        for node in ast.walk(tree):
            if isinstance(node, kinds):
                yield path, node


def n_lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def big_classes(mods) -> list[str]:
    over = []
    for path, c in nodes(mods, ast.ClassDef):
        n_methods = sum(isinstance(b, FUNCTIONS) for b in c.body)
        n_fields = sum(isinstance(b, ast.AnnAssign) for b in c.body)
        if n_lines(c) > MAX_CLASS_LINES or n_methods > MAX_CLASS_METHODS or n_fields > MAX_CLASS_FIELDS:
            over.append(f"{path}:{c.lineno} {c.name}: {n_lines(c)} lines, {n_methods} methods, {n_fields} fields")
    return over


def long_functions(mods) -> list[str]:
    return [f"{path}:{f.lineno} {f.name}: {n_lines(f)} lines"
            for path, f in nodes(mods, FUNCTIONS) if n_lines(f) > MAX_FUNCTION_LINES]


def variadic(mods) -> set[str]:
    """Names of functions taking *args: their calls pass one list (a command line), not parameters."""
    return {f.name for _, f in nodes(mods, FUNCTIONS) if f.args.vararg}


def calls_by_place(mods, lists: set[str]) -> list[str]:
    over = []
    for path, call in nodes(mods, ast.Call):
        callee = ast.unparse(call.func)
        if len(call.args) <= MAX_POSITIONAL or callee.startswith(FOREIGN) or f".{FOREIGN[0]}" in callee \
                or callee.split(".")[-1] in lists:
            continue
        over.append(f"{path}:{call.lineno} {callee}: {len(call.args)} positional arguments")
    return over


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_class_is_too_big_to_read_whole(folder):
    assert not (over := big_classes(modules(folder))), "\n".join(over)


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_function_is_longer_than_a_screen(folder):
    assert not (over := long_functions(modules(folder))), "\n".join(over)


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_call_passes_more_than_seven_by_place(folder):
    lists = set().union(*(variadic(modules(f)) for f in FOLDERS))
    assert not (over := calls_by_place(modules(folder), lists)), "\n".join(over)


def test_the_bounds_catch_what_they_are_for():
    """One over each bound is found, one at each bound is not; a command line's *args and a foreign
    call are let through, and nothing else."""
    def module(n_fields: int, n_body: int, n_args: int, callee: str = "g") -> list:
        fields = "".join(f"    f{i}: int\n" for i in range(n_fields))
        body = "".join(f"    x{i} = {i}\n" for i in range(n_body - 1))
        return [(Path("m.py"), ast.parse(f"class C:\n{fields or '    pass'}\ndef f():\n{body or '    pass'}\n"
                                         f"{callee}({', '.join('0' * n_args)})\n"))]

    at = module(MAX_CLASS_FIELDS, MAX_FUNCTION_LINES, MAX_POSITIONAL)
    over = module(MAX_CLASS_FIELDS + 1, MAX_FUNCTION_LINES + 1, MAX_POSITIONAL + 1)
    assert not big_classes(at) and not long_functions(at) and not calls_by_place(at, set())
    assert len(big_classes(over)) == len(long_functions(over)) == len(calls_by_place(over, set())) == 1
    assert not calls_by_place(over, {"g"})
    assert not calls_by_place(module(0, 1, 12, "native._lib.lever_layer_forward"), set())
    assert calls_by_place(module(0, 1, 12, "native.layer_forward"), set())


CYCLE_TESTS = ("tests/stages/test_tree_expand.py", "tests/tree")


def test_the_tree_cycle_is_driven_through_its_public_face():
    """Tests build, advance and read TreeCycle and TreeLearner without a private attribute."""
    private = []
    for name in CYCLE_TESTS:
        for path in [ROOT / name] if name.endswith(".py") else sorted((ROOT / name).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not private, "\n".join(private)
