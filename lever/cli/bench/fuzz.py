"""`lever bench fuzz`: crafted and mutated GGUFs through the loader and the tokenizer (lever.fuzz)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from lever.cli.common import add_common
from lever.fuzz.runner import run_fuzz


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("fuzz", help="crafted and mutated GGUFs through the loader and the tokenizer")
    b.add_argument("--n", type=int, default=100_000, help="inputs to run")
    b.add_argument("--seed", type=int, default=0, help="random seed")
    b.add_argument("--corpus", type=Path, default=None, help="write each finding's input here, named by hash")
    b.add_argument("--timeout", type=float, default=5.0, help="seconds an input may take before it is a hang")
    add_common(b)
    b.set_defaults(func=main)
    return b


def main(args) -> int:
    n = args.n
    columns = (TextColumn("fuzzing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
               TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("fuzz", total=n, status="")

        def progress(r) -> None:
            if r.n % 50 == 0 or r.n == n:
                bar.update(task, completed=r.n, status=f"{r.rate:.0f}/s, {sum(r.findings.values())} findings")

        report = run_fuzz(n, args.seed, args.corpus, args.timeout, progress=progress)
    print("\n".join(report.lines()))
    return 0
