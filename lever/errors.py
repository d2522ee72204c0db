"""The one exception type for user-facing failures.

A LeverError carries a single line naming the file, key or value at fault; the CLI prints it
as `lever: error: ...` and exits non-zero, without a traceback unless --debug.
"""


class LeverError(Exception):
    """A user error or an environment problem, described in one line."""


def shown(text: str, limit: int = 80) -> str:
    """A name or value from a file as it may appear in a one-line message: as-is when short and
    printable, else quoted with escapes (a crafted key may hold newlines, or be empty) and cut."""
    if text and text.isprintable() and len(text) <= limit:
        return text
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
