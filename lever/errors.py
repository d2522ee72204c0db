"""The one exception type for user-facing failures.

A LeverError carries a single line naming the file, key or value at fault; the CLI prints it
as `lever: error: ...` and exits non-zero, without a traceback unless --debug.
"""


class LeverError(Exception):
    """A user error or an environment problem, described in one line."""
