"""What each test file starts: processes (`lever serve` servers, browsers, other CLI runs), model
loads (lever.model's `Model`, a streamed target, an `Engine`, `lever.load`), and its wall time
(setup, call and teardown of its tests). Where the suite's time goes, by file, for
docs/measurements.md; off unless asked for:

    python -m pytest -p tests.census --census /tmp/census.json [-n 0] ...

Each xdist worker writes its own part (`census.json.gwN`); the controller adds them into one file.
Counted in the process that runs the test: the processes a server starts itself, and the loads
inside a started process, are not seen (a started process is the unit of cost here anyway)."""

from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

KINDS = ("seconds", "tests", "servers", "browsers", "cli", "processes", "models", "targets", "engines", "loads")
_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_current = ["(collection)"]


def pytest_addoption(parser) -> None:
    parser.addoption("--census", metavar="FILE", help="write per-file counts of processes and model loads to FILE")


def _count(kind: str) -> None:
    _counts[_current[0]][kind] += 1


def _kind_of(args) -> str:
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    line = " ".join(argv)
    if "lever" in line and " serve" in line or "llama-server" in line:
        return "servers"
    if "chrom" in line:
        return "browsers"
    if "-m lever" in line or Path(argv[0]).name == "lever":
        return "cli"
    return "processes"


def _wrap(owner, name: str, kind) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        _count(kind(args, kwargs) if callable(kind) else kind)
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def pytest_configure(config) -> None:
    if not config.getoption("census"):
        return
    from lever.api import llm
    from lever.model import transformer
    from lever.pipelines import engine, target

    _wrap(subprocess.Popen, "__init__", lambda a, kw: _kind_of(kw.get("args", a[1] if len(a) > 1 else "")))
    _wrap(transformer.Model, "__init__", "models")
    _wrap(target.FlashTarget, "open", "targets")  # a classmethod: wrapped as the bound method it is
    _wrap(engine.Engine, "open", "engines")
    _wrap(llm, "load", "loads")
    import lever

    lever.load = llm.load


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.location[0]
    start = time.perf_counter()
    yield
    _counts[item.location[0]]["seconds"] += time.perf_counter() - start
    _counts[item.location[0]]["tests"] += 1


def pytest_sessionfinish(session) -> None:
    out = session.config.getoption("census")
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        Path(f"{out}.{worker}").write_text(json.dumps(_counts))
        return
    total: dict[str, collections.Counter] = collections.defaultdict(collections.Counter, _counts)
    for part in Path(out).parent.glob(Path(out).name + ".gw*"):
        for file, counts in json.loads(part.read_text()).items():
            total[file].update(counts)
        part.unlink()
    Path(out).write_text(json.dumps({f: {k: round(c[k], 1) for k in KINDS if c[k]} for f, c in sorted(total.items())},
                                    indent=1))
