"""Files Lever ships beside its code: the example configs, the model pair they name, prompts.

From a source tree they are the repository's `examples/` (what a developer edits); from an
installed wheel they are the copy CMake installs into the package (`lever/examples/`), so
`lever run` works from any directory either way.
"""

from __future__ import annotations

from pathlib import Path

import lever
from lever.errors import LeverError


def examples_dir() -> Path:
    source = Path(lever.__file__).resolve().parent.parent / "examples"
    if (source / "default.toml").is_file():
        return source
    for base in lever.__path__:
        if (Path(base) / "examples" / "default.toml").is_file():
            return Path(base) / "examples"
    raise LeverError("the shipped examples (default.toml, the model pair) are missing from this install")


def shipped(*parts: str) -> Path:
    """A shipped file by its path under examples/, e.g. shipped("prompts", "code.txt")."""
    return examples_dir().joinpath(*parts)
