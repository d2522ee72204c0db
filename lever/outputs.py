"""Every file Lever writes goes through here: checked before the work that produces it, then
written atomically under exactly the name given.

Sits beside lever.errors, below everything that writes (the commands' --out, --json, --plot and
--trace, `lever convert`, the tracer): `writable_destination` refuses, in one line naming the
flag and the path, a destination that could only fail once the work is done (a missing or
read-only folder, a directory, a FIFO); `atomic_write` / `atomic_path` write a temp file in the
destination's folder and rename it into place, so a reader never sees half a file and an
error, Ctrl-C or SIGTERM (raised as an exception in the main thread) leaves neither a partial
output nor the temp file. Temp names carry the writer's pid, so `reap_stale` can remove what a
SIGKILLed writer left without touching a live one's.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lever.errors import LeverError

TEMP_TAG = "lever-tmp"  # .NAME.<pid>.<random>.lever-tmp


def writable_destination(path, what: str = "output") -> Path:
    """`path` as a Path once a file can be written there: its folder exists and is writable, and
    it is absent or a regular file (a FIFO would block, a directory or a device is no output).
    `what` names it in the error: a flag (`--out`) or a noun ("trace")."""
    p = Path(path)
    who = f"{what} {p}" if what.startswith("-") else f"{p}"
    tail = "" if what.startswith("-") else f" (the {what})"
    if not p.name or p.name in (".", ".."):
        raise LeverError(f"{who}: is a directory, not a file{tail}")
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # a loop of links, a path through a file, a name too long
        raise LeverError(f"{who}: cannot write: {e.strerror or e}{tail}") from None
    if mode is not None and not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
                if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
        raise LeverError(f"{who}: is {kind}, not a regular file to write{tail}")
    parent = p.parent
    if not parent.is_dir():
        raise LeverError(f"{who}: no such directory {parent}{tail}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LeverError(f"{who}: cannot write: directory {parent} is not writable{tail}")
    return p


def _temp_pattern(name: str) -> re.Pattern:
    # a writer handed our temp name may add its own ".tmp" beside it (lever.policy's writers do)
    return re.compile(rf"\.{re.escape(name)}\.(\d+)\.[^.]+\.{TEMP_TAG}(\.tmp)?")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


def reap_stale(path) -> list[Path]:
    """Removes the temp files an earlier writer of `path` left when it was killed outright
    (SIGKILL, a power cut: no handler ran): those of this name whose pid is not running."""
    p = Path(path)
    pattern, removed = _temp_pattern(p.name), []
    try:
        entries = list(p.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
    return removed


@contextlib.contextmanager
def atomic_path(path, what: str = "output") -> Iterator[Path]:
    """A temp path beside `path` for a writer that wants a name (a library's save); renamed onto
    `path` when the block ends normally, removed on any exception (KeyboardInterrupt too)."""
    p = writable_destination(path, what)
    reap_stale(p)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{p.name}.{os.getpid()}.", suffix=f".{TEMP_TAG}", dir=p.parent)
    except OSError as e:
        raise LeverError(f"{p}: cannot write: {e.strerror or e}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make the output private
        yield tmp
        os.replace(tmp, p)
    except OSError as e:
        raise LeverError(f"{p}: cannot write: {e.strerror or e}") from None
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + ".tmp")):  # ours, and a nested writer's own
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_write(path, mode: str = "w", what: str = "output"):
    """A file object whose contents become `path`, exactly that name, when the block ends
    normally (flushed and synced first); on any exception nothing is left behind."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode {mode!r}")
    with atomic_path(path, what) as tmp:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_json(path, obj, what: str = "--json") -> None:
    """`obj` as indented JSON at `path`, atomically (the benches' --json)."""
    import json

    with atomic_write(path, "w", what) as f:
        f.write(json.dumps(obj, indent=1))
