"""What every `lever` subcommand shares: the common flags, the parsing of list arguments, and the
one set of checks every command's numbers and files go through.

A numeric flag's `type=` here is a bound from the table the config and the API use
(lever.model.sampling.LIMITS, lever.config's lengths), so `--temp nan` is refused by argparse
itself, in one line naming the flag (exit 2, as argparse's usage errors), before anything is
loaded, exactly as `[generate] temperature = nan` and `temperature=nan` in the API are
refused. What a flag's value alone
cannot say (two flags together, a file's kind and size, where an output goes) each command
checks in its `check_args(args)`, also set as `args.check`, before any work: main() runs it
first, and a fuzzer of argument vectors can call `args.check(args)` after `parse_args`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import platform
import re
import sys
from pathlib import Path
from typing import NoReturn

from lever.backends.flash.config import parse_bytes
from lever.config import CTX, KNOBS, MAX_CTX, N_PREDICT, THREADS, check_overrides
from lever.errors import LeverError, regular_file
from lever.model.sampling import Range
from lever.outputs import writable_destination
from lever.policy.memory import mem_overrides

# A prompt, turns or corpus file is read whole and tokenized: past these sizes it is a wrong
# file (a model, a log), not text for a context of at most MAX_CTX tokens (~4 bytes each).
MAX_PROMPT_BYTES = 16 * MAX_CTX
MAX_CORPUS_BYTES = 256 * 2**20
MAX_ROUNDS = 1000  # timed rounds of a bench or a profile: medians are stable long before
MAX_BENCH_TOKENS = 4096  # tokens per run of a bench: each run is a process per pipeline, budget and prompt
INT64_MAX = 2**63 - 1


def cpu_model() -> str:
    """The CPU's name, as profiles and benchmark reports record it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                # "model" alone is x86's model number, not a name
                if key.lower() in ("model name", "hardware", "cpu model") or key == "Model":
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
    """The flags every command has; and its usage errors as every other error is, one line."""
    p.error = functools.partial(usage_error, p)
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.add_argument("--threads", type=bounded(THREADS), default=0, help="compute threads (0: all cores)")


def add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--mem", type=memory_size, metavar="SIZE",
                   help="DRAM the run may use (e.g. 2G, 1536MiB): [memory] limit, and the target's layers "
                        "kept resident fill what the rest of the plan leaves ([flash] dram_budget = \"fill\"); "
                        "a --set of either wins")


def memory_size(text: str) -> str:
    """--mem: a positive size in bytes (2G, 1536MiB, 2000000000), as [memory] limit takes it."""
    n = parse_bytes(text)
    if n is None or n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size in bytes (e.g. 2G, 1536MiB), got {text!r}")
    return text.strip()


def mem_sets(args) -> list[str]:
    """--mem as the --set overrides it stands for, to go before the command line's own."""
    mem = getattr(args, "mem", None)
    return [] if mem is None else mem_overrides(mem)


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """argparse's error for a command's arguments as one line naming the flag (`lever: error:
    --temp: must be ...`), exit 2 as argparse's own: the house's one-line errors, where argparse
    would print the whole usage first."""
    message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
    print(f"lever: error: {message} (usage: {parser.prog} -h)", file=sys.stderr)
    sys.exit(2)


def bounded(limit: Range):
    """An argparse `type=`: the flag's text as a number within `limit`; anything else is
    argparse's usage error naming the flag (exit 2)."""

    def parse(text: str):
        try:
            value = int(text, 10) if limit.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if limit.integer else 'a number'}, "
                                             f"got {text[:40]!r}") from None
        problem = limit.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem if len(text) <= 40 else problem.split(", got")[0])
        return value

    parse.__name__ = "integer" if limit.integer else "number"  # argparse names the type in some errors
    return parse


def int_in(lo: int, hi: int):
    return bounded(Range(lo, hi, integer=True))


def float_in(lo: float, hi: float, lo_open: bool = False):
    return bounded(Range(lo, hi, lo_open=lo_open))


n_predict = bounded(N_PREDICT)  # tokens to generate, as [generate] n_predict takes them
n_ctx = bounded(CTX)
port = int_in(1, 65535)
rounds = int_in(1, MAX_ROUNDS)
bench_tokens = int_in(1, MAX_BENCH_TOKENS)


def add_knobs(p: argparse.ArgumentParser, *keys: str, defaults: dict | None = None, call: bool = False) -> None:
    """Flags of generation knobs (lever.config.KNOBS, by [generate] key: the flag, its bounds and
    its help come from there), each bounded as [generate] bounds it (`call`: as a call to the API
    does). The parsed value sits at the key (args.temperature for --temp); default None, the
    config's, unless `defaults` gives one."""
    for key in keys:
        k = KNOBS[key]
        p.add_argument(k.option, dest=k.key, type=bounded(k.call if call else k.limit),
                       default=(defaults or {}).get(key), help=k.help)


def knob_values(args) -> dict:
    """The knobs a command line set: [generate] key -> value (what add_knobs parsed, None left out)."""
    return {key: v for key in KNOBS if (v := getattr(args, key, None)) is not None}


def check_sets(args) -> None:
    """Each --set is one TOML value for a known key, checked as the config checks it."""
    check_overrides(getattr(args, "set", ()) or ())


def input_text_file(path, flag: str, what: str = "file", max_bytes: int = MAX_PROMPT_BYTES):
    """A text file a flag names, checked before anything is loaded: a regular file (a FIFO never
    ends), and no bigger than is ever text for a model's context or a config."""
    p = regular_file(path, what)
    size = p.stat().st_size
    if size > max_bytes:
        raise LeverError(f"{flag} {p}: {size:,} bytes, over the {max_bytes:,} a {what} may have")
    return p


CONSTRAINT_FLAGS = (("--json-schema", "json_schema"), ("--grammar", "grammar"))  # flag -> compile_args's keyword


def add_constraint(p: argparse.ArgumentParser, whose: str = "the text") -> None:
    """--json-schema FILE / --grammar FILE: structured output (lever.model.grammar)."""
    p.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                   help=f"{whose} must be JSON this JSON Schema accepts (structured output)")
    p.add_argument("--grammar", type=Path, default=None, metavar="FILE",
                   help=f"{whose} must follow this grammar (Lark, or llama.cpp's GBNF)")


def constraint_file(args) -> tuple[str, Path] | None:
    """The one of --json-schema / --grammar given (its flag and file), checked; None: neither."""
    given = [(flag, getattr(args, key)) for flag, key in CONSTRAINT_FLAGS if getattr(args, key) is not None]
    if len(given) > 1:
        raise LeverError("--json-schema and --grammar: give one")
    for flag, path in given:
        input_text_file(path, flag, "file")
    return given[0] if given else None


def output_file(path, flag: str):
    """An output a flag names: None stays None, else checked writable (lever.outputs)."""
    return None if path is None else writable_destination(path, flag)


def parse_tokens(text: str) -> list[int]:
    """--tokens: comma-separated ids, each in int64's range (the width every kernel indexes
    with); whether each is below the vocabulary is checked against the model."""
    try:
        ids = [int(t, 10) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise LeverError(f"--tokens: expected comma-separated integers, got {text[:80]!r}") from None
    bad = next((t for t in ids if not 0 <= t <= INT64_MAX), None)
    if bad is not None:
        raise LeverError(f"--tokens: token id {bad if abs(bad) < 10**20 else str(bad)[:20] + '...'} is not in "
                         f"[0, {INT64_MAX}]")
    if len(ids) > MAX_CTX:
        raise LeverError(f"--tokens: {len(ids)} ids, over the {MAX_CTX} of any context")
    return ids


def parse_list(text: str, flag: str, limit: Range, max_items: int = 64) -> tuple:
    """A comma-separated flag, each item within `limit`, at most `max_items` of them."""
    parse = bounded(limit)
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise LeverError(f"{flag}: no values given")
    if len(items) > max_items:
        raise LeverError(f"{flag}: {len(items)} values, at most {max_items}")
    try:
        values = tuple(parse(x.strip()) for x in items)
    except argparse.ArgumentTypeError as e:
        raise LeverError(f"{flag}: {e}") from None
    if len(set(values)) != len(values):
        raise LeverError(f"{flag}: {text[:80]!r} repeats a value")
    return values
