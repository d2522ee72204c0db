"""llama.cpp's collection of real chat templates (models/templates/*.jinja at commit 0c1e570), which
the tool-call tests read: found in a llama.cpp tree already here, else taken from the
llama-cpp-python 0.3.36 sdist on PyPI (the one ../shared/tools/build-llama-cpp builds from),
downloaded once (~11 s, 77 MB) and only its templates kept, under $LEVER_MODELS' parent. Where it
cannot be had (offline, LEVER_NO_FETCH=1) the tests needing it skip, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

SDIST = "llama-cpp-python==0.3.36"
INNER = "vendor/llama.cpp/models/templates"
TREES = [Path(os.environ.get("LLAMA_CPP_TEMPLATES", "/nonexistent")),
         Path("/tmp/llama-cpp/src/llama_cpp_python-0.3.36") / INNER]  # build-llama-cpp's default tree


def _fetch(dest: Path) -> str:
    """The sdist's templates into `dest`; why not, or ""."""
    if os.environ.get("LEVER_NO_FETCH") == "1":
        return "LEVER_NO_FETCH=1"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                              "llama-cpp-python", SDIST, "-d", tmp], capture_output=True, text=True, timeout=600)
        if got.returncode != 0:
            return f"pip download {SDIST} failed: {got.stderr.strip().splitlines()[-1:]}"
        out = Path(tmp) / "templates"
        out.mkdir()
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            for m in tar.getmembers():
                if m.isfile() and m.name.endswith(".jinja") and f"/{INNER}/" in m.name:
                    (out / Path(m.name).name).write_bytes(tar.extractfile(m).read())
        try:
            out.rename(dest)  # atomic: another worker may have put it there first
        except OSError:
            pass
    return ""


def templates() -> Path:
    """The folder of llama.cpp's templates, or the calling test skips with the reason."""
    for tree in TREES:
        if tree.is_dir():
            return tree
    from lever.hub.store import models_dir

    cached = models_dir().parent / "llama.cpp-0c1e570-templates"
    why = "" if cached.is_dir() else _fetch(cached)
    if not cached.is_dir():
        pytest.skip(f"llama.cpp's chat templates absent ({why or 'not fetched'})")
    return cached
