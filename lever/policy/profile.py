"""Profiles: what this machine's flash and CPU cost, measured once and kept in a msgpack file.

This module is the file format and the [profile] config section; `lever profile -c CONFIG`
(lever/cli/profile.py) does the measuring: the configured flash (whole streamed passes through
Prefetch, single small and chunk reads), one target layer of each tensor-type mix at
token-count buckets over a realistic KV length, the resident draft's whole forward at batch
buckets, and both output heads per row. lever.policy.cost_model turns a profile into the
per-node latencies TreeExpand weighs drafted nodes by. Nothing here runs during generation.
"""

from __future__ import annotations

import itertools
import os
import types
import typing
from pathlib import Path

import attrs
import msgpack

from lever.backends.flash.config import MODES, FlashConfig
from lever.errors import LeverError, shown
from lever.gguf.identity import ModelIdentity
from lever.outputs import atomic_write
from lever.policy.fields import MAX_COUNT, Fields, read_msgpack

FORMAT = "lever-profile"
FORMAT_VERSION = 2  # 2: resident layers (tile layout) timed apart from streamed ones
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # tree sizes a verification pass sees; draft batches too
HEAD_ROWS = (1, 8, 64)  # lm_head: one accepted row, a typical accepted path, a whole tree
KV_ROWS = 256  # committed context rows every timed pass attends over
SMALL_READ_BYTES = 4096  # one page: the smallest O_DIRECT read, so its time is the latency
PROFILE_SUFFIX = ".lever-profile.msgpack"


def _check_table(where: str, xs: tuple, ys: tuple) -> None:
    if not xs or len(xs) != len(ys):
        raise ValueError(f"{where}: {len(xs)} buckets for {len(ys)} timings")
    if any(b <= a for a, b in itertools.pairwise(xs)) or xs[0] < 1:
        raise ValueError(f"{where}: buckets must be ascending and >= 1, got {xs}")
    if any(not y >= 0 for y in ys):  # also rejects NaN
        raise ValueError(f"{where}: timings must be >= 0, got {ys}")


@attrs.frozen(kw_only=True)  # many numbers of one type: by name, never by place
class FlashProfile:
    """The target's flash as configured (first five fields, FlashConfig's names) and as measured.

    `read_*` and `*_read_s` are measured with the configured emulation (cap, latency);
    `device_*` with the emulation off, so a cost model can apply a different cap to them.
    """

    mode: str
    queue_depth: int
    chunk_bytes: int
    bandwidth_cap_bytes_per_s: float
    read_latency_ms: float
    pass_bytes: int  # what one pass reads with every layer streamed (dram_budget 0)
    read_bytes_per_s: float  # pass_bytes / the pass's pure read time, through Prefetch
    small_read_s: float  # one SMALL_READ_BYTES read, nothing else in flight: the per-read latency
    chunk_read_s: float  # one chunk_bytes read, nothing else in flight
    device_read_bytes_per_s: float
    device_small_read_s: float


@attrs.frozen(kw_only=True)
class TargetProfile:
    """The target: one layer's compute at token-count buckets, streamed (GGUF's row layout, as
    a staging buffer holds it) and resident (packed into the tile layout at load, which the
    kernels stream faster, most of all at one token: docs/measurements.md,
    'Tile layout against row layout'), and its lm_head."""

    model: ModelIdentity
    n_layer: int
    kv_rows: int  # committed rows attended over while timing
    tokens: tuple[int, ...]
    layer_s: tuple[float, ...]  # seconds of one streamed layer over tokens[i] tokens (mean over the layer mix)
    resident_layer_s: tuple[float, ...]  # the same of a resident layer
    layers_timed: tuple[int, ...]  # a few layers of each tensor-type mix, weighted by the mix's count
    head_rows: tuple[int, ...]
    head_s: tuple[float, ...]  # Model.logits over head_rows[i] rows

    def __attrs_post_init__(self):
        _check_table("target layer_s", self.tokens, self.layer_s)
        _check_table("target resident_layer_s", self.tokens, self.resident_layer_s)
        _check_table("target head_s", self.head_rows, self.head_s)


@attrs.frozen
class DraftProfile:
    """The resident draft: a whole forward (embedding and every layer) at batch buckets."""

    model: ModelIdentity
    n_layer: int
    kv_rows: int
    batch: tuple[int, ...]
    forward_s: tuple[float, ...]  # Model.forward over batch[i] tokens
    head_rows: tuple[int, ...]
    head_s: tuple[float, ...]

    def __attrs_post_init__(self):
        _check_table("draft forward_s", self.batch, self.forward_s)
        _check_table("draft head_s", self.head_rows, self.head_s)


@attrs.frozen(kw_only=True)
class Profile:
    device: str  # CPU model
    platform: str
    threads: int  # compute threads the kernels ran on
    date: str  # ISO 8601, UTC
    method: str
    lever_version: str
    flash: FlashProfile
    target: TargetProfile
    draft: DraftProfile | None = None
    load_avg_1min: tuple[float, ...] = ()  # the machine's load before and after: was it shared?


# -- msgpack


def write(profile: Profile, path: str | os.PathLike) -> Path:
    """Writes atomically (a reader never sees half a profile; a temp file is never left)."""
    path = Path(path)
    data = {"format": FORMAT, "version": FORMAT_VERSION, "profile": attrs.asdict(profile)}
    with atomic_write(path, "wb", "profile") as f:
        f.write(msgpack.packb(data, use_bin_type=True))
    return path


def read(path: str | os.PathLike) -> Profile:
    """The profile at path, every field checked (lever.policy.fields): type, shape and range;
    anything else is one line naming the file and the field."""
    path = Path(path)
    data = read_msgpack(path, "profile file", "make one with `lever profile -c CONFIG`")
    f = Fields(path, "profile")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise LeverError(f"{path}: not a lever profile (no '{FORMAT}' format marker)")
    version = data.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise LeverError(f"{path}: profile format version {shown(repr(version), 40)}, this lever reads "
                         f"{FORMAT_VERSION}: re-run `lever profile`")
    return _structure(f, Profile, f.key(data, "profile", ""), "profile")


# What each field may hold beyond its type, by field name: (lo, hi) for numbers, the choices of
# a string. Every number in a profile is a count, a size, a rate or a time, so none is negative;
# the upper bounds are far past any machine's and keep the cost model's sums finite.
_BUCKET = (1, 2**20)
_RATE = (1.0, 1e13)  # bytes/s: a zero or NaN bandwidth would make every read time infinite
_RANGES: dict[str, tuple] = {
    "queue_depth": (1, 2**16), "chunk_bytes": (1, MAX_COUNT), "threads": (1, 2**16), "n_layer": (1, 2**20),
    "kv_rows": (0, 2**31), "tokens": _BUCKET, "head_rows": _BUCKET, "batch": _BUCKET, "layers_timed": (0, 2**20),
    "read_bytes_per_s": _RATE, "device_read_bytes_per_s": _RATE, "bandwidth_cap_bytes_per_s": (0.0, 1e13),
    "read_latency_ms": (0.0, 1e9), "load_avg_1min": (0.0, 1e6),
}
_SECONDS = (0.0, 1e6)  # any float field not named above: a time in seconds
_CHOICES: dict[str, tuple[str, ...]] = {"mode": MODES}


def _structure(f: Fields, cls, value, where: str):
    """A dict read back into the attrs class it was written from, every value checked."""
    value = f.map(value, where)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for a in attrs.fields(cls):
        if a.name in value:
            kwargs[a.name] = _value(f, hints[a.name], value[a.name], f"{where}.{a.name}", a.name)
        elif a.default is attrs.NOTHING:
            raise f.fail(f"{where}.{a.name}", "missing")
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError, LeverError) as e:  # the classes' own checks: tables, buckets
        raise f.fail(where, str(e)) from None
    if cls is FlashProfile:  # the cost model rebuilds the profiled flash config from these
        try:
            FlashConfig(mode=obj.mode, queue_depth=obj.queue_depth, chunk_bytes=obj.chunk_bytes,
                        bandwidth_cap_bytes_per_s=obj.bandwidth_cap_bytes_per_s, read_latency_ms=obj.read_latency_ms)
        except LeverError as e:
            raise LeverError(f"{f.path}: {str(e).replace('[flash] ', f'{where}.', 1)}") from None
    if cls is TargetProfile and obj.layers_timed and max(obj.layers_timed) >= obj.n_layer:
        raise f.fail(f"{where}.layers_timed", f"layer {max(obj.layers_timed)} of a {obj.n_layer}-layer model")
    return obj


def _value(f: Fields, hint, v, where: str, name: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if v is None and type(None) in args:
            return None
        (arm,) = [a for a in args if a is not type(None)]
        return _value(f, arm, v, where, name)
    if hint is ModelIdentity:
        m = f.map(v, where)
        return ModelIdentity(f.string(f.key(m, "path", where), f"{where}.path"),
                             f.integer(f.key(m, "size_bytes", where), f"{where}.size_bytes"),
                             f.hex_digest(f.key(m, "sha256_first_mib", where), f"{where}.sha256_first_mib"))
    if attrs.has(hint):
        return _structure(f, hint, v, where)
    if origin is tuple:
        xs = f.array(v, where, max_n=2**16)
        return tuple(_value(f, typing.get_args(hint)[0], x, f"{where}[{i}]", name) for i, x in enumerate(xs))
    if hint is float:
        return f.number(v, where, *_RANGES.get(name, _SECONDS))
    if hint is int:
        return f.integer(v, where, *_RANGES.get(name, (0, MAX_COUNT)))
    if hint is str:
        return f.string(v, where, choices=_CHOICES.get(name))
    raise f.fail(where, f"cannot be read as {getattr(hint, '__name__', hint)}")  # a field type this reader lacks


# -- the [profile] config section


@attrs.frozen
class ProfileConfig:
    """Which measured profile the cost model reads."""

    path: str = ""  # msgpack from `lever profile`, relative to the config file; "": no profile, analytic fallback


def default_path(target: str | os.PathLike) -> Path:
    """Next to the target model: a profile belongs to one model file (and one machine)."""
    return Path(str(target) + PROFILE_SUFFIX)
