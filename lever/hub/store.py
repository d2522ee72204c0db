"""The folder pulled models live in, $LEVER_MODELS (default ~/.cache/lever/models), and what it
holds: the models there, each file's digest, the partial downloads a later pull resumes.

Catalogue files sit at the top of the folder under their own names (the configs in examples/
name them there); a hub file sits under its repository, `OWNER/REPO/FILE`, so two repositories'
files of one name never meet. Hidden folders (a pull's staging) are not models.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import attrs

from lever.errors import LeverError

# label, bytes done, bytes in all (None: unknown); called as the work moves
Progress = Callable[[str, int, "int | None"], None]
READ_CHUNK = 4 << 20
PART = ".part"  # a download in progress: FILE.part beside FILE
MODEL_SUFFIX = ".gguf"


def quiet(label: str, done: int, total: int | None) -> None:
    """The progress of a caller that shows none."""


def models_dir() -> Path:
    """$LEVER_MODELS, else ~/.cache/lever/models (where examples/lever.toml looks)."""
    return Path(os.environ.get("LEVER_MODELS") or Path.home() / ".cache" / "lever" / "models").expanduser()


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + PART)


def inside(root: Path, relative: str) -> Path:
    """root/relative, refused in one line when `relative` would leave root (`..`, an absolute path)."""
    path = (root / relative).resolve()
    if not path.is_relative_to(root.resolve()) or path == root.resolve():
        raise LeverError(f"{relative!r}: not a file name inside {root}")
    return root / relative


def file_digest(path: Path, kind: str = "sha256", progress: Progress = quiet) -> str:
    """A file's hex digest: "sha256", or "git-sha1" (git's blob id, what the hub's ETag is for a
    file kept in git rather than LFS)."""
    size = path.stat().st_size
    h = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % size)
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
            done += len(chunk)
            progress(f"checking {path.name.removesuffix(PART)}", done, size)
    return h.hexdigest()


@attrs.frozen
class Held:
    """A file in the models folder: its path under the folder, its size, whether it is a
    download still in progress (FILE.part)."""

    relative: str
    size: int
    partial: bool


def held(root: Path | None = None) -> list[Held]:
    """Every model file under `root` (GGUFs, and the partial downloads of any file), by path."""
    root = models_dir() if root is None else root
    if not root.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            partial = name.endswith(PART)
            if name.startswith(".") or not (partial or name.endswith(MODEL_SUFFIX)):
                continue
            path = Path(dirpath) / name
            try:
                size = path.stat().st_size
            except OSError:  # gone while we looked (a pull just renamed its .part)
                continue
            found.append(Held(relative=path.relative_to(root).as_posix(), size=size, partial=partial))
    return sorted(found, key=lambda h: h.relative)
