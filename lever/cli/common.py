"""What every `lever` subcommand shares: the common flags and the parsing of list arguments."""

from __future__ import annotations

import argparse

from lever.errors import LeverError


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")


def add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")


def parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise LeverError(f"--tokens: expected comma-separated integers, got {text!r}") from None


def parse_floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise LeverError(f"{flag}: expected numbers separated by commas, got {text!r}") from None
