"""Checked reading of the files Lever writes and later reads back, value by value.

Three kinds of file come back into a run after Lever wrote them: the device profile the cost
model prices trees with (lever.policy.profile), the predictor artifact with its acceptance
table (lever.policy.predictor, from `lever calibrate`) and saved sessions, whose rows go
straight into the KV caches (lever.pipelines.saved_session). A value from one of them lands in
latency tables, pruning scores or cache rows, where a string, a NaN, a negative count or a
list one entry short would surface as a traceback deep inside a run, or as quietly wrong
trees. So each loader decodes its file once (`read_msgpack`) and takes every value through a
`Fields` of that file: type, shape and range, each failure one LeverError line naming the
file and the field, e.g. "p.msgpack: calibration.trials[1][3]: is the string 'x', expected a
number".

The checked loaders, one per kind (what `lever bench fuzz` mutates files against):
`lever.policy.profile.read(path)`, `lever.policy.predictor.Artifact.load(path)` (and
`Artifact.read(path, target, n_layer=...)` for the checks that need the model) and
`lever.pipelines.saved_session.load(path)` (and `read(path, kv=..., ...)` against an engine).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import msgpack
import numpy as np

from lever.errors import LeverError, kind_of, regular_file, shown

MAX_COUNT = 2**48  # past any real count of bytes, rows or layers, and exact in a float64
MAX_TEXT_CHARS = 4096  # names, dates, paths and methods in these files are far shorter
_HEX = re.compile(r"[0-9a-f]*")


def read_msgpack(path: str | os.PathLike, what: str, missing_hint: str = "", *, max_bytes: int | None = None,
                 max_items: int | None = None) -> object:
    """The decoded contents of a msgpack file Lever wrote, or one line naming the file: not a
    regular file, unreadable, or not msgpack at all (garbage, truncated, trailing bytes). With
    `max_bytes`, a bigger file (a sparse one too) is refused before it is read; `max_items`
    bounds every array and map in it, so a small file cannot decode into a huge structure."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise LeverError(f"{p}: no such {what}{f' ({missing_hint})' if missing_hint else ''}")
    regular_file(p, what)  # not a FIFO: reading one would never end
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if max_bytes is not None and size > max_bytes:
                raise LeverError(f"{p}: {size} bytes, more than any {what} of this model pair can be ({max_bytes})")
            raw = f.read(size + 1 if max_bytes is not None else -1)
    except OSError as e:
        raise LeverError(f"{p}: cannot read {what}: {e.strerror or e}") from None
    if max_bytes is not None and len(raw) > max_bytes:  # it grew while we looked
        raise LeverError(f"{p}: more than any {what} of this model pair can be ({max_bytes} bytes)")
    limits = {} if max_items is None else {"max_array_len": max_items, "max_map_len": max_items}
    try:
        # map keys must be strings (every file here is written with string keys), so nothing
        # unhashable or odd reaches the checks as a key
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, **limits)
    except Exception as e:  # noqa: BLE001 -- ValueError subclasses mostly, but any failure means "not msgpack"
        raise LeverError(f"{p}: not a {what} (corrupt msgpack: {shown(str(e) or type(e).__name__, 80)})") from None


def _kind(v) -> str:
    """What a decoded value is, short enough for one line whatever it holds."""
    if v is None:
        return "nil"
    if isinstance(v, dict):
        return f"a map of {len(v)}"
    if isinstance(v, (bytes, bytearray)):
        return f"{len(v)} bytes"
    if isinstance(v, (str, list, tuple)):
        return kind_of(v)
    return shown(kind_of(v), 60)


class Fields:
    """Values out of one decoded file, each checked; `fail` and every check name the file and
    the field ("dotted.path[3]"), in one line."""

    def __init__(self, path: str | os.PathLike, what: str):
        self.path = Path(path)
        self.what = what

    def fail(self, field: str, why: str) -> LeverError:
        return LeverError(f"{self.path}: {field}: {why}")

    def _wrong(self, field: str, v, expected: str) -> LeverError:
        return self.fail(field, f"is {_kind(v)}, expected {expected}")

    def map(self, v, field: str) -> dict:
        if not isinstance(v, dict):
            raise self._wrong(field, v, "a map")
        return v

    def key(self, m: dict, name: str, field: str):
        """m[name], which must be there; `field` is m's own name ("" at the top)."""
        if name not in m:
            raise self.fail(f"{field}.{name}" if field else name, "missing")
        return m[name]

    def integer(self, v, field: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._wrong(field, v, "an integer")
        if not lo <= v <= hi:
            raise self.fail(field, f"= {v} is out of range [{lo}, {hi}]")
        return v

    def number(self, v, field: str, lo: float = -1e12, hi: float = 1e12, *, above: float | None = None) -> float:
        """A finite number in [lo, hi] (and > above when given); integers are taken as floats."""
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._wrong(field, v, "a number")
        x = float(v) if not isinstance(v, int) or abs(v) < 2**1023 else math.inf
        if not math.isfinite(x):
            raise self.fail(field, f"= {v!r} is not a finite number")
        if not lo <= x <= hi or (above is not None and not x > above):
            bound = f"({above}, {hi}]" if above is not None else f"[{lo}, {hi}]"
            raise self.fail(field, f"= {x!r} is out of range {bound}")
        return x

    def string(self, v, field: str, *, choices: tuple[str, ...] | None = None, max_chars: int = MAX_TEXT_CHARS) -> str:
        if not isinstance(v, str):
            raise self._wrong(field, v, "a string")
        if len(v) > max_chars:
            raise self.fail(field, f"is {len(v)} characters long (at most {max_chars})")
        if choices is not None and v not in choices:
            raise self.fail(field, f"{shown(v, 40)!r} is not one of {', '.join(map(repr, choices))}")
        return v

    def hex_digest(self, v, field: str, n_chars: int = 64) -> str:
        s = self.string(v, field)
        if len(s) != n_chars or not _HEX.fullmatch(s):
            raise self.fail(field, f"{shown(s, 40)!r} is not a {n_chars}-digit lowercase hex digest")
        return s

    def array(self, v, field: str, *, n: int | None = None, min_n: int = 0, max_n: int = MAX_COUNT) -> list:
        """A list of exactly n entries (or between min_n and max_n)."""
        if not isinstance(v, (list, tuple)):
            raise self._wrong(field, v, "a list" if n is None else f"a list of {n}")
        if n is not None and len(v) != n:
            raise self.fail(field, f"has {len(v)} entries, expected {n}")
        if not min_n <= len(v) <= max_n:
            raise self.fail(field, f"has {len(v)} entries, expected {min_n} to {max_n}")
        return list(v)

    def numbers(self, v, field: str, *, n: int | None = None, min_n: int = 0, lo: float = -1e12,
                hi: float = 1e12) -> np.ndarray:
        """A list of finite numbers in [lo, hi], as float64."""
        xs = self.array(v, field, n=n, min_n=min_n)
        return np.array([self.number(x, f"{field}[{i}]", lo, hi) for i, x in enumerate(xs)], np.float64)

    def blob(self, v, field: str, n_bytes: int) -> bytes:
        if not isinstance(v, bytes):
            raise self._wrong(field, v, f"{n_bytes} bytes")
        if len(v) != n_bytes:
            raise self.fail(field, f"is {len(v)} bytes, expected {n_bytes}")
        return v
