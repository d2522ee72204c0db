"""`lever bench fuzz`: hostile inputs through what users reach with them (lever.fuzz): crafted and
mutated GGUFs (the loader, the tokenizer, non-finite weights), configs with --set overrides, the
files Lever reads back, and command lines (this package's parser, hence passed from here)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from lever.cli.common import INT64_MAX, add_common, float_in, int_in
from lever.errors import LeverError
from lever.fuzz.runner import run_fuzz


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("fuzz", help="hostile GGUFs, configs, read-back files and command lines through Lever")
    b.add_argument("--n", type=int_in(1, MAX_INPUTS), default=100_000, help="inputs to run")
    b.add_argument("--seed", type=int_in(0, INT64_MAX), default=0, help="random seed")
    b.add_argument("--corpus", type=Path, default=None, help="write each finding's input here, named by hash")
    b.add_argument("--timeout", type=float_in(0.0, MAX_TIMEOUT_S, lo_open=True), default=5.0,
                   help="seconds an input may take before it is a hang")
    add_common(b)
    b.set_defaults(func=main, check=check_args)
    return b


MAX_INPUTS = 10_000_000  # a few hours at the runner's rate; the figure is 100,000
MAX_TIMEOUT_S = 600.0  # past this a hang is not told from a slow input, and one hang stalls the run


def check_args(args) -> None:
    """--corpus: a directory, or one its parent can hold, before the first input runs."""
    if args.corpus is not None:
        c = args.corpus
        if c.exists() and not c.is_dir():
            raise LeverError(f"--corpus {c}: is not a directory")
        folder = c if c.is_dir() else c.parent
        if not folder.is_dir():
            raise LeverError(f"--corpus {c}: no such directory {folder}")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise LeverError(f"--corpus {c}: directory {folder} is not writable")


def main(args) -> int:
    from lever.cli.main import build_parser  # the command-line family fuzzes every parser of the package

    check_args(args)
    n = args.n
    columns = (TextColumn("fuzzing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
               TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("fuzz", total=n, status="")

        def progress(r) -> None:
            if r.n % 50 == 0 or r.n == n:
                bar.update(task, completed=r.n, status=f"{r.rate:.0f}/s, {sum(r.findings.values())} findings")

        report = run_fuzz(n, args.seed, args.corpus, args.timeout, progress=progress, parser_factory=build_parser)
    print("\n".join(report.lines()))
    return 0
