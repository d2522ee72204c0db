"""Shared fixtures: paths to the real models beside the project, and tiny GGUFs made on demand."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_gguf import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODELS = SHARED / "models"
STORIES = MODELS / "stories260K.gguf"
QWEN_DIR = Path(os.environ.get("LEVER_MODELS", Path.home() / ".cache" / "lever" / "models"))
QWEN_TARGET = QWEN_DIR / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_DRAFT = QWEN_DIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def require(path: Path) -> Path:
    if not path.exists():
        hint = "run ../shared/tools/fetch-qwen-pair" if "qwen" in path.name else "needs ../shared/models"
        pytest.skip(f"{path} absent ({hint})")
    return path


@pytest.fixture(scope="session")
def stories() -> Path:
    return require(STORIES)


@pytest.fixture(scope="session")
def qwen_target() -> Path:
    return require(QWEN_TARGET)


@pytest.fixture(scope="session")
def qwen_draft() -> Path:
    return require(QWEN_DRAFT)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, wtype, **kw) -> path of a cached tiny GGUF."""
    made: dict[tuple, Path] = {}
    base = tmp_path_factory.mktemp("tiny")

    def make(arch: str = "llama", wtype: str = "F32", **kw) -> Path:
        key = (arch, wtype, tuple(sorted(kw.items())))
        if key not in made:
            name = "_".join([arch, wtype] + [f"{k}{v}" for k, v in sorted(kw.items())])
            made[key] = write_tiny_model(base / f"{name}.gguf", arch, wtype, **kw)
        return made[key]

    return make
