"""The `lever` command: one parser over the subcommands, and user-facing errors for all of them.

Each subcommand is a module of this package with `add_parser(sub)` and `main(args)`, a thin
layer over the library (as mlx-lm's commands are). A LeverError (or a missing file, or Ctrl-C)
becomes one line on stderr and a non-zero exit, with the traceback only under --debug.
"""

from __future__ import annotations

import argparse
import sys

from lever.backends.cpu import native
from lever.cli import bench, calibrate, chat, convert, generate, inspect, logits, profile, run, serve
from lever.cli.common import lever_version
from lever.errors import LeverError

COMMANDS = (run, generate, chat, inspect, logits, calibrate, profile, convert, bench, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lever", description="Flash-resident speculative decoding of LLMs.")
    parser.add_argument("--version", action="version", version=f"lever {lever_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads and hasattr(args, "set"):  # a command with a config: --threads is its [runtime] threads
        args.set.append(f"runtime.threads={args.threads}")
    try:
        with native.default_threads(args.threads):
            return args.func(args)
    except LeverError as e:
        if args.debug:
            raise
        print(f"lever: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if args.debug:
            raise
        print(f"lever: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nlever: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
