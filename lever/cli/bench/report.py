"""What the benches share of their input and output: prompts files, geometric means, plots.

Below every bench; the JSON they write goes through lever.outputs.write_json.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

from lever.errors import LeverError, read_text
from lever.outputs import atomic_path


def read_prompts(path: str | Path) -> list[str]:
    """Prompts separated by lines holding only `---`."""
    p = Path(path)
    text = read_text(p, "prompts file")
    prompts, cur = [], []
    for line in text.splitlines(keepends=True):
        if line.strip() == "---":
            prompts.append("".join(cur))
            cur = []
        else:
            cur.append(line)
    prompts.append("".join(cur))
    prompts = [q for q in prompts if q.strip()]
    if not prompts:
        raise LeverError(f"{p}: no prompts (separate them with lines holding only ---)")
    return prompts


def geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else 0.0


@contextlib.contextmanager
def figure(path, figsize=(6, 4)):
    """A matplotlib figure and its axes for `--plot`, written to `path` (atomically, in the
    format its suffix names) when the block ends; matplotlib is imported only here."""
    try:  # an optional dependency: imported only when a plot is asked for
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LeverError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield fig, ax
        ax.grid(alpha=0.3)
        fig.tight_layout()
        with atomic_path(path, "--plot") as tmp:  # the format from the name asked for, not the temp's
            fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)
