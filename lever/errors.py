"""The one exception type for user-facing failures.

A LeverError carries a single line naming the file, key or value at fault; the CLI prints it
as `lever: error: ...` and exits non-zero, without a traceback unless --debug.
"""

import stat
from pathlib import Path

import numpy as np


class LeverError(Exception):
    """A user error or an environment problem, described in one line."""


def kind_of(value) -> str:
    """What a metadata value is, for "... is X, expected Y" messages."""
    if isinstance(value, str):
        return f"the string {shown(value, 40)!r}"
    if isinstance(value, (list, tuple, np.ndarray)):
        return f"an array of {len(value)}"
    return f"{type(value).__name__} {value!r}"


def shown(text: str, limit: int = 80) -> str:
    """A name or value from a file as it may appear in a one-line message: as-is when short and
    printable, else quoted with escapes (a crafted key may hold newlines, or be empty) and cut."""
    if text and text.isprintable() and len(text) <= limit:
        return text
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def regular_file(path, what: str = "file"):
    """`path` as a Path once it is known to be a regular file, else one line saying what it is:
    a FIFO would block the open forever, a device or a directory is nobody's model or config."""
    p = Path(path)
    try:
        mode = p.stat().st_mode  # follows links: a link to a FIFO is a FIFO
    except FileNotFoundError:
        raise LeverError(f"{p}: no such {what}") from None
    except OSError as e:
        raise LeverError(f"{p}: cannot read: {e.strerror or e}") from None
    if stat.S_ISREG(mode):
        return p
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
    raise LeverError(f"{p}: is {kind}, not a regular {what}" if kind != "not a file" else f"{p}: not a regular {what}")


def read_text(path, what: str = "file") -> str:
    """A regular file's text; bytes that are not UTF-8 are named by their offset."""
    p = regular_file(path, what)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise LeverError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LeverError(f"{p}: not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                         f"is this the {what}?") from None
