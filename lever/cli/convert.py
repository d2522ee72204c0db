"""`lever convert IN OUT`: rewrite a GGUF with 4096-byte tensor alignment, for O_DIRECT reads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lever.cli.common import add_common, int_in
from lever.errors import LeverError, regular_file
from lever.gguf.convert import MAX_ALIGNMENT, MIN_ALIGNMENT, check_alignment, convert
from lever.outputs import writable_destination


def _alignment(text: str) -> int:
    value = int_in(MIN_ALIGNMENT, MAX_ALIGNMENT)(text)
    try:
        check_alignment(value)
    except LeverError as e:  # argparse's usage error names the flag
        raise argparse.ArgumentTypeError(str(e).removeprefix("alignment ")) from None
    return value


def add_parser(sub) -> argparse.ArgumentParser:
    cv = sub.add_parser("convert", help="rewrite a GGUF with 4096-byte tensor alignment (for O_DIRECT reads)")
    cv.add_argument("input", type=Path)
    cv.add_argument("output", type=Path)
    cv.add_argument("--alignment", type=_alignment, default=4096,
                    help=f"bytes, a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}] "
                         f"(default 4096: a page, for O_DIRECT)")
    add_common(cv)
    cv.set_defaults(func=main, check=check_args)
    return cv


def check_args(args) -> None:
    regular_file(args.input, "model file")
    writable_destination(args.output, "output")


def main(args) -> int:
    check_args(args)
    convert(args.input, args.output, args.alignment)
    print(f"wrote {args.output} (tensors aligned to {args.alignment} bytes)", file=sys.stderr)
    return 0
