"""The house's layers: every import in lever/, stages/ and backends/ points down, and none circles.

Read from the source with `ast` (module-level and function-local imports alike, so a lazy
import cannot hide a circle). stages/ and backends/ are the packages lever.stages and
lever.backends (pyproject.toml maps them), and are placed by that name.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

# Bottom to top. A module may import its own unit and the units of lower floors only.
FLOORS = (
    ("lever.errors", "lever.signals"),  # one-line failures; how a signal stops a command
    # every file Lever writes: checked before the work, written atomically; JSON values checked without recursing
    ("lever.outputs", "lever.nesting"),
    ("lever.hub",),  # models fetched by name into $LEVER_MODELS, checked: moves bytes, loads nothing
    ("lever.gguf", "lever.shipped"),  # what a file says; where the shipped examples are
    ("lever.backends.cpu",),  # the kernels' binding, weights in their layouts, one layer
    ("lever.model",),  # a model in DRAM, sampling, generation, the float64 reference
    ("lever.dataflow", "lever.backends.flash", "lever.backends.qnn"),
    ("lever.policy",),  # decisions: tree growth, costs, predictor, memory plan, placement
    ("lever.tree",),  # a cycle's token tree as it grows: nodes, free sources, drafting ahead, the builder
    ("lever.stages",),
    ("lever.config",),
    ("lever.pipelines",),
    ("lever.api",),  # load -> LLM: generate, stream, chat, sessions
    ("lever.serve",),  # the OpenAI-compatible server over an LLM
    ("lever.fuzz",),  # hostile inputs through everything below: GGUFs, configs, files read back
    ("lever.cli",),
    ("lever.__main__", "lever"),  # lever: the package's own __init__ (matched exactly)
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("stages", "backends"):
        parts.insert(0, "lever")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    """Every module with code (the empty __init__ of a namespace such as lever.backends has none)."""
    return {module_name(p): p for base in ("lever", "stages", "backends") for p in (ROOT / base).rglob("*.py")
            if p.stat().st_size}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from pkg import mod` imports mod; `from mod import name` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t != "lever":
                found.add(t)
    return found


def unit(name: str) -> tuple[int, str]:
    best = max(((f, u) for f, units in enumerate(FLOORS) for u in units
                if name == u or (u != "lever" and name.startswith(u + "."))),
               key=lambda fu: len(fu[1]), default=None)
    assert best is not None, f"{name} is on no floor of FLOORS: place it"
    return best


def graph() -> dict[str, set[str]]:
    src = sources()
    return {name: imports(name, path, set(src)) for name, path in src.items()}


def test_every_module_is_on_a_floor_and_imports_only_its_own_unit_or_lower():
    wrong = []
    for name, deps in graph().items():
        floor, own = unit(name)
        for dep in deps:
            dep_floor, dep_unit = unit(dep)
            if dep_unit != own and dep_floor >= floor:
                wrong.append(f"{name} (floor {floor}) imports {dep} (floor {dep_floor})")
    assert not wrong, "imports pointing up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == 1:
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in sorted(g):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_check_sees_a_circle_and_an_upward_import(tmp_path):
    # The walk itself: a module importing a higher floor, and two importing each other.
    a = tmp_path / "a.py"
    a.write_text("from lever.cli.main import main\nimport lever.gguf.file\n")
    assert imports("lever.gguf.spec", a, {"lever.cli.main", "lever.gguf.file"}) == {"lever.cli.main", "lever.gguf.file"}
    assert unit("lever.gguf.spec")[0] < unit("lever.cli.main")[0]
