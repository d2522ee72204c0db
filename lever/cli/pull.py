"""`lever pull NAME | OWNER/REPO/FILE`: a model into $LEVER_MODELS, checked, its path printed.

NAME is one of the catalogue's (lever.hub.catalogue; `lever list` shows them, a pair name pulls
both files); OWNER/REPO/FILE a file of a Hugging Face hub repository ($HF_ENDPOINT applies).
Each path goes to stdout, one a line (`$(lever pull stories260k)`); what happened to each file
and a progress bar go to stderr. A pull cut short resumes where it stopped.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from lever.cli.common import add_common
from lever.hub import hf
from lever.hub.catalogue import lookup
from lever.hub.pull import pull


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("pull", help="fetch a model by name or REPO/FILE into $LEVER_MODELS, checked")
    p.add_argument("model", metavar="NAME|REPO/FILE",
                   help="a catalogue name (`lever list`) or a hub file, e.g. " + hf.EXAMPLE)
    p.add_argument("--revision", default="main", help="for REPO/FILE: the branch, tag or commit (default: main)")
    add_common(p)
    p.set_defaults(func=main, check=check_args)
    return p


def check_args(args) -> None:
    """A name the catalogue does not know must at least read as OWNER/REPO/FILE (no network)."""
    if not lookup(args.model):
        hf.parse_spec(args.model)


class Bar:
    """The pull's progress as rich bars on stderr, one per label (a download, a check)."""

    def __init__(self):
        console = Console(stderr=True)
        # no terminal, no bars: rich would still end them with a blank line before the command's own
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                             TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal)
        self.tasks: dict[str, int] = {}

    def __call__(self, label: str, done: int, total: int | None) -> None:
        if label not in self.tasks:
            self.tasks[label] = self.bars.add_task(label, total=total)
        self.bars.update(self.tasks[label], completed=done, total=total)


def main(args) -> int:
    check_args(args)
    bar = Bar()
    with bar.bars:
        pulled = pull(args.model, revision=args.revision, progress=bar)
    for p in pulled:
        how = f"{p.checked} checked" if not p.checked.startswith("not checked") else p.checked
        note = f"; {p.note}" if p.note else ""
        print(f"{p.name}: {'fetched' if p.fetched else 'present'}, {how}{note}", file=sys.stderr)
        print(p.path, flush=True)
    return 0
