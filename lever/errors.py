"""The one exception type for user-facing failures.

A LeverError carries a single line naming the file, key or value at fault; the CLI prints it
as `lever: error: ...` and exits non-zero, without a traceback unless --debug.
"""

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
