"""`lever convert IN OUT`: rewrite a GGUF with 4096-byte tensor alignment, for O_DIRECT reads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lever.cli.common import add_common
from lever.gguf.convert import convert


def add_parser(sub) -> argparse.ArgumentParser:
    cv = sub.add_parser("convert", help="rewrite a GGUF with 4096-byte tensor alignment (for O_DIRECT reads)")
    cv.add_argument("input", type=Path)
    cv.add_argument("output", type=Path)
    cv.add_argument("--alignment", type=int, default=4096)
    add_common(cv)
    cv.set_defaults(func=main)
    return cv


def main(args) -> int:
    convert(args.input, args.output, args.alignment)
    print(f"wrote {args.output} (tensors aligned to {args.alignment} bytes)", file=sys.stderr)
    return 0
