"""What every `lever` subcommand shares: the common flags and the parsing of list arguments."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform

from lever.errors import LeverError


def cpu_model() -> str:
    """The CPU's name, as profiles and benchmark reports record it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key.lower() in ("model name", "hardware", "cpu model") or key == "Model":  # "model" alone: x86's number
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def lever_version() -> str:
    try:
        return importlib.metadata.version("lever")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


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
