"""Shared fixtures: paths to the real models (the small ones ship in tests/data; the Qwen pair is
pulled into $LEVER_MODELS by lever.hub, or its tests skip saying why), and tiny GGUFs made on demand."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

import pytest
from hypothesis import settings

from lever.errors import LeverError
from lever.hub.pull import pull
from lever.hub.store import models_dir
from tests.sizes import QUICK as QUICK_PROFILE
from tests.tiny_gguf import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


DATA = ROOT / "tests" / "data"  # the small real models and corpora, shipped with their provenance (SOURCES.md)
MODELS = DATA / "models"
CORPORA = DATA / "corpora"
STORIES = MODELS / "stories260K.gguf"
LLAMA2 = MODELS / "llama-2-tiny-random.gguf"
QWEN_DIR = models_dir()  # $LEVER_MODELS, else ~/.cache/lever/models: where `lever pull` puts models
QWEN_TARGET = QWEN_DIR / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_DRAFT = QWEN_DIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def find_shared() -> Path | None:
    """The project's shared tools (llama.cpp's build, memcap), an optional extra no test needs:
    $LEVER_SHARED, else a `shared/` beside the clone or beside any folder above it."""
    if os.environ.get("LEVER_SHARED"):
        return Path(os.environ["LEVER_SHARED"]).resolve()
    for above in ROOT.parents:
        if (above / "shared" / "tools").is_dir():
            return above / "shared"
    return None


SHARED = find_shared() or ROOT.parent / "shared"
# llama.cpp as an independent reference: llama-cpp-python, finding libllama through
# LLAMA_CPP_LIB_PATH, else through a build beside the project (where the developers keep one).
LLAMA_CPP_LIB = ROOT.parent / "ref" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"

_pulls: dict[str, str] = {}  # catalogue name -> "" once pulled, else why it could not be


def pull_model(name: str) -> str:
    """The test command sets up what it needs: `lever pull NAME` into $LEVER_MODELS, tried once
    a session (the Qwen pair takes ~1 min), never under LEVER_NO_FETCH=1; why it failed, or ""."""
    if name not in _pulls:
        if os.environ.get("LEVER_NO_FETCH") == "1":
            _pulls[name] = "LEVER_NO_FETCH=1"
        else:
            deadline = time.monotonic() + 600
            while True:
                try:
                    pull(name, root=QWEN_DIR)
                    _pulls[name] = ""
                except LeverError as e:
                    # another worker's pull of the same files: wait for it rather than skip
                    if "another pull is writing it" in str(e) and time.monotonic() < deadline:
                        time.sleep(2)
                        continue
                    _pulls[name] = str(e)
                break
    return _pulls[name]


def require(path: Path) -> Path:
    """`path`, pulled first when it is the Qwen pair's; else the test skips, saying why."""
    if not path.exists() and path.parent == QWEN_DIR and "qwen" in path.name:
        if why := pull_model("qwen2.5-coder"):
            pytest.skip(f"{path} absent (`lever pull qwen2.5-coder` failed: {why})")
    if not path.exists():
        pytest.skip(f"{path} absent")
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
    """The shipped test data is part of the clone: a checkout without it (a sparse or LFS-less
    one) would skip a tenth of the suite and pass, so it stops here with one line instead."""
    missing = [p.name for p in (STORIES, LLAMA2) if not p.is_file()]
    if missing:
        pytest.exit(f"{', '.join(missing)}: not in {MODELS}; this checkout lacks the shipped test data", returncode=4)


# The contributor's check (`python -m pytest -m quick`, about 3 minutes): every layer once, each
# property at the quick profile's size. Folders are taken whole, but for the files named after them.
QUICK = {
    "tests/native": ("test_arm64_run.py", "test_arm64_build.py"),  # the kernels, scalar against SIMD
    "tests/backends/cpu": (), "tests/gguf": ("test_vocab_map.py",), "tests/model": (),  # the model core
    "tests/dataflow": (), "tests/policy": ("test_memory.py", "test_placement.py"), "tests/tree": (),
    "tests/stages": (),
    "tests/pipelines/test_compose.py": (), "tests/pipelines/test_draws.py": (),  # lossless on the shipped pair
    "tests/backends/flash/test_faults.py": (), "tests/test_api.py": (), "tests/test_config.py": (),
    "tests/serve/test_server.py": (), "tests/cli/test_run.py": (),  # the server's routes; the command
    "tests/test_layers.py": (), "tests/test_data.py": (),
}


def _quick(path: str) -> bool:
    return any((path == part or path.startswith(part + "/")) and path.rsplit("/", 1)[-1] not in but
               for part, but in QUICK.items())


# The files that take longest (serial seconds, docs/measurements.md 'Where the suite's time goes'),
# given to the workers first: the last file a worker takes is then a short one, not a 150 s one
# begun when the other worker is done.
LONGEST = ("tests/test_readme.py", "tests/cli/test_live_memory.py", "tests/pipelines/test_structured.py",
           "tests/native/test_arm64_run.py", "tests/pipelines/test_residency.py", "tests/serve/test_llama.py",
           "tests/integration/test_qwen_pair.py", "tests/stages/test_accept.py", "tests/cli/test_bench_serve.py",
           "tests/integration/test_flash_qwen.py", "tests/pipelines/test_compose.py", "tests/test_config.py",
           "tests/backends/flash/test_device.py", "tests/pipelines/test_penalties.py", "tests/cli/test_bench_fim.py",
           "tests/policy/test_memory.py", "tests/serve/test_server.py", "tests/serve/test_page.py",
           "tests/serve/test_hostile.py", "tests/test_signals.py", "tests/gguf/test_vocab_map.py",
           "tests/policy/test_placement.py", "tests/cli/test_main.py", "tests/cli/test_inputs.py",
           "tests/pipelines/test_draws.py", "tests/cli/test_chat.py")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _quick(item.location[0]):
            item.add_marker(pytest.mark.quick)
    rank = {f: i for i, f in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.location[0], len(rank)))  # stable: a file's own order stays


_STOPS = (signal.SIGTERM, signal.SIGHUP)


def _interrupted(signum, _frame) -> None:
    """A run that is cut (`timeout`, CI's limit, a closed terminal) ends as Ctrl-C would: pytest
    then prints what passed and failed so far. Once: a second signal while the summary is being
    written is ignored."""
    for s in _STOPS:
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def pytest_configure(config) -> None:
    for s in _STOPS:
        signal.signal(s, _interrupted)
    # the contributor's quick check, `-m quick`, sizes its properties by the quick profile too
    if config.getoption("markexpr", "") == "quick" and config.getoption("hypothesis_profile", None) is None:
        settings.load_profile(QUICK_PROFILE)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session) -> None:
    for s in _STOPS:  # the tests are over: a signal now would only cut the summary short
        signal.signal(s, signal.SIG_IGN)
