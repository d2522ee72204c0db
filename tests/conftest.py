"""Shared fixtures: paths to the real models beside the project, and tiny GGUFs made on demand."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from tests.tiny_gguf import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def find_shared() -> Path | None:
    """The shared models and tools: $LEVER_SHARED, else a `shared/` beside the clone or beside
    any folder above it (a clone nested one level deeper still finds them)."""
    if os.environ.get("LEVER_SHARED"):
        return Path(os.environ["LEVER_SHARED"]).resolve()
    for above in ROOT.parents:
        if (above / "shared" / "models").is_dir():
            return above / "shared"
    return None


SHARED = find_shared() or ROOT.parent / "shared"
MODELS = SHARED / "models"
STORIES = MODELS / "stories260K.gguf"
QWEN_DIR = Path(os.environ.get("LEVER_MODELS", Path.home() / ".cache" / "lever" / "models"))
QWEN_TARGET = QWEN_DIR / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_DRAFT = QWEN_DIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# llama.cpp as an independent reference: llama-cpp-python, finding libllama through
# LLAMA_CPP_LIB_PATH, else through a build beside the project (where the developers keep one).
LLAMA_CPP_LIB = ROOT.parent / "ref" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"


FETCH_QWEN = SHARED / "tools" / "fetch-qwen-pair"
_fetch_tried: list[str] = []


def fetch_qwen_pair() -> None:
    """The test command sets up what it needs: the Qwen pair is fetched once (~30 s) when
    absent, unless LEVER_NO_FETCH=1; a failed fetch leaves its tests skipped with the reason."""
    if _fetch_tried or os.environ.get("LEVER_NO_FETCH") == "1" or not FETCH_QWEN.exists():
        return
    import subprocess

    proc = subprocess.run(["bash", str(FETCH_QWEN), str(QWEN_DIR)], capture_output=True, text=True, timeout=900)
    _fetch_tried.append(proc.stderr.strip().splitlines()[-1] if proc.returncode and proc.stderr else "")


def require(path: Path) -> Path:
    if not path.exists() and "qwen" in path.name:
        fetch_qwen_pair()
    if not path.exists():
        hint = f"{FETCH_QWEN} failed: {_fetch_tried[0]}" if _fetch_tried and _fetch_tried[0] else \
            "run ../shared/tools/fetch-qwen-pair" if "qwen" in path.name else "needs ../shared/models"
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


_QUIET = []  # keeps the ctypes log callback alive


def import_llama_cpp():
    """llama-cpp-python with llama.cpp's logging silenced; raises when it is not usable."""
    if LLAMA_CPP_LIB.exists():
        os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(LLAMA_CPP_LIB))
    import llama_cpp

    if not _QUIET:
        _QUIET.append(llama_cpp.llama_log_callback(lambda level, text, data: None))
        llama_cpp.llama_log_set(_QUIET[0], ctypes.c_void_p(0))
    return llama_cpp


@pytest.fixture(scope="session")
def llama_cpp():
    try:
        return import_llama_cpp()
    except Exception as e:  # missing package, or it cannot find libllama
        pytest.skip(f"llama-cpp-python not usable ({type(e).__name__}: {e}); to compare with llama.cpp, "
                    "pip install llama-cpp-python (or its Python part, "
                    "with LLAMA_CPP_LIB_PATH set to a libllama build)")


@pytest.fixture
def qwen_small() -> Path:
    return require(QWEN_DRAFT)


# Files on a real disk (O_DIRECT needs one): the flash, convert and cancellation tests share them.
from tests.backends.flash.files import disk_dir, stories_aligned, stories_copy, streaming_model  # noqa: E402, F401


def pytest_sessionstart(session) -> None:
    """A run without the shared models would skip a tenth of the suite and pass: that green
    would be a lie, so it stops here with one line saying what to set."""
    if not STORIES.exists() and os.environ.get("LEVER_ALLOW_NO_SHARED") != "1":
        pytest.exit(f"{STORIES} absent: set LEVER_SHARED to the folder holding models/ and tools/ "
                    "(../shared beside the clone), or LEVER_ALLOW_NO_SHARED=1 to skip its tests", returncode=4)
