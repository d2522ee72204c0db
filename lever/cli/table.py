"""Tables the commands print: rich's, no wider than 80 columns, handed out line by line.

Commands take an `out` callable (print by default; tests pass their own), so a table is
rendered to text first: without a terminal, rich would otherwise pick its own width.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

WIDTH = 80


def show(columns: Sequence[str], rows: Sequence[Sequence[object]], out: Callable[[str], None] = print,
         title: str | None = None) -> None:
    """Prints rows under columns; the first column is left-aligned (names), the rest right (figures)."""
    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, title_style=None, show_edge=False,
              collapse_padding=True,
              header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right", overflow="fold")
    for r in rows:
        t.add_row(*(str(x) for x in r))
    buf = io.StringIO()
    Console(file=buf, width=WIDTH, force_terminal=False, color_system=None, highlight=False).print(t)
    for line in buf.getvalue().rstrip("\n").split("\n"):
        out(line.rstrip())
