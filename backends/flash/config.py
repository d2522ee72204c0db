"""The flash backend's settings and the residency plan they imply.

`FlashConfig` is what a user sets (CLI flags, config file); `plan_residency` turns its DRAM
budget into the set of layers read once and kept, the rest being streamed through the
staging window on every pass. Nothing here touches a file.
"""

from __future__ import annotations

import math
import re

import attrs

from lever.errors import LeverError

# Emulation bounds: beyond them a run would seem to hang, never a device worth emulating.
MIN_CAP_BYTES_PER_S = 1e6
MAX_LATENCY_MS = 10_000.0
PAGE_BYTES = 4096  # O_DIRECT alignment: a multiple of every logical block size we meet (512, 4096)
MODES = ("direct", "mmap", "cached")

# a bare K/M/G is binary, as in memory limits elsewhere (systemd's MemoryMax=2G, docker -m 2g)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "k": 2**10, "m": 2**20, "g": 2**30}
_BYTES_RE = re.compile(r"^\s*(\d+)\s*([kmg]i?b|[kmg]|b)?\s*$", re.IGNORECASE)
_LAYERS_RE = re.compile(r"^\s*(\d+)\s*(l|layers?)\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")
_FRACTION_RE = re.compile(r"^\s*(\d*\.\d*)\s*$")


@attrs.frozen
class Budget:
    """A parsed DRAM budget: `amount` bytes, a fraction of all layer bytes, or a count of layers."""

    kind: str  # "bytes" | "fraction" | "layers" | "fill"
    amount: float  # "fill": 0, the amount is what [memory] limit leaves (lever.policy.memory.fill_residency)


def parse_bytes(value) -> int | None:
    """A size in bytes: an int, or digits with an optional unit, decimal (`500MB`) or binary
    (`256MiB`); None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and (m := _BYTES_RE.match(value)):
        return int(m[1]) * _UNITS[(m[2] or "").lower()]
    return None


def parse_budget(value: int | float | str | Budget, key: str = "dram_budget") -> Budget:
    """The budget syntax, one of:

    - bytes: an int (`268435456`) or a string of digits with an optional unit, decimal
      (`500MB`, `2GB`, `1000kB`) or binary (`256MiB`, `1GiB`);
    - fraction of the total layer bytes: a float in [0, 1] (`0.25`), a string with a decimal
      point (`"0.25"`, `"1.0"`) or a percentage (`"25%"`);
    - layer count: a string ending in `L` or `layers` (`"8L"`, `"8 layers"`);
    - `"fill"`: every layer that fits in `[memory] limit` beside everything else the run
      plans (`--mem`), placed with the memory plan (lever.policy.memory.fill_residency).

    A bare int is always bytes (so `1` is one byte, not 100%); write `1.0` or `"100%"` for all.
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise LeverError(f"[flash] {key}: must be bytes, a fraction or a layer count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise LeverError(f"[flash] {key}: must not be negative, got {value}")
        return Budget("bytes", value)
    if isinstance(value, float):
        return _fraction(value, key, value)
    if isinstance(value, str):
        if value.strip().lower() == "fill":
            return Budget("fill", 0)
        if (n := parse_bytes(value)) is not None:
            return Budget("bytes", n)
        if m := _LAYERS_RE.match(value):
            return Budget("layers", int(m[1]))
        if m := _PERCENT_RE.match(value):
            return _fraction(float(m[1]) / 100.0, key, value)
        if (m := _FRACTION_RE.match(value)) and m[1] != ".":
            return _fraction(float(m[1]), key, value)
    raise LeverError(
        f"[flash] {key}: {value!r} is not bytes (e.g. 512MiB), a fraction (0.25, 25%), a layer count (8L) or \"fill\""
    )


def _fraction(f: float, key: str, shown) -> Budget:
    if not (0.0 <= f <= 1.0) or math.isnan(f):
        raise LeverError(f"[flash] {key}: a fraction must be in [0, 1], got {shown!r}")
    return Budget("fraction", f)


def spread(n_layers: int, k: int) -> list[int]:
    """k of n_layers indices spaced evenly, each in the middle of its share of the depth.

    Centred shares leave equal runs of streamed layers between resident ones, also across
    the wrap from the last layer of one pass to the first of the next, so the reader always
    has a resident layer's compute time to fetch the following streamed run under.
    """
    return [int((j + 0.5) * n_layers / k) for j in range(k)]


def respread(n_layers: int, held: frozenset[int], k: int) -> frozenset[int]:
    """k resident layers, changing as few as can be from those `held`: fewer keep k of them
    spread evenly among them (nothing is read to shrink), more add the rest spread evenly over
    the streamed ones (nothing held is dropped to grow)."""
    kept = sorted(held)
    if k <= len(kept):
        return frozenset(kept[j] for j in spread(len(kept), k)) if k else frozenset()
    streamed = [i for i in range(n_layers) if i not in held]
    return frozenset(kept) | frozenset(streamed[j] for j in spread(len(streamed), k - len(kept)))


def plan_residency(layer_bytes: list[int], budget: int | float | str | Budget) -> frozenset[int]:
    """The layers kept in DRAM: as many as the budget allows, spread evenly across depth."""
    b = parse_budget(budget)
    n = len(layer_bytes)
    if b.kind == "fill":  # a run's plan places these (RunPlan.resolve); layer sizes alone cannot
        raise LeverError('[flash] dram_budget: "fill" is placed by a run\'s memory plan, against [memory] limit')
    if b.kind == "layers":
        return frozenset(spread(n, min(int(b.amount), n)))
    limit = b.amount if b.kind == "bytes" else b.amount * sum(layer_bytes)
    # Layers may differ in size, so the largest evenly spread set that fits is searched for
    # from the top; k = 0 always fits, so the budget is never exceeded.
    for k in range(n, 0, -1):
        chosen = spread(n, k)
        if sum(layer_bytes[i] for i in chosen) <= limit:
            return frozenset(chosen)
    return frozenset()


def _check(cond: bool, key: str, value, what: str) -> None:
    if not cond:
        raise LeverError(f"[flash] {key}: must be {what}, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


@attrs.frozen
class FlashConfig:
    """How the target model's layers reach DRAM from flash."""

    mode: str = "direct"
    """"direct": O_DIRECT reads into the staging window, bypassing the page cache (the
    default: the bytes read are the bytes asked for, with no cache to hide the device).
    "mmap": the file is mapped; each chunk is faulted in (MADV_WILLNEED), copied into the
    staging window and dropped from the page cache at once.
    "cached": buffered reads whose pages stay in the page cache, so the kernel's LRU decides
    what a later pass finds in DRAM: an LRU block cache, for comparing with static residency
    (`lever bench cap`). The bytes counted are the bytes asked for, cached or not; what came
    from the device is the kernel's count."""

    queue_depth: int = 4
    """Reads in flight at once. The class itself is synchronous; the pipeline stage that
    drives it runs reads in worker threads under a CapacityLimiter of this size."""

    chunk_bytes: int = 2 * 2**20
    """Size of one read (a multiple of 4096). A layer is split into chunks so that
    `queue_depth` reads can be in flight for it; flash controllers reach full bandwidth
    from ~512 KiB requests, and more chunks per layer cost more syscalls."""

    window_layers: int = 3
    """Buffers in the staging window, each the size of the largest streamed layer: one
    being computed on, one being read, one queued - more only if reads are bursty."""

    bandwidth_cap_bytes_per_s: float = 0
    """Emulated flash bandwidth shared by all reads (0 = none, the device's own speed). A
    read of n bytes then takes at least n / cap seconds; e.g. 2.1e9 for a phone's UFS 3.1."""

    read_latency_ms: float = 0
    """Emulated latency added to every read (0 = none); reads in flight overlap theirs, as
    commands queued on a UFS device do."""

    read_retries: int = 1
    """Retries of a read that failed with EIO or EAGAIN, after a short backoff (0: none). One
    gets past a transient fault (a link reset, a card reader's hiccup) and a persistent one
    still ends the run within a second; see store.py for what is never retried."""

    dram_budget: int | float | str = 0
    """DRAM for layers kept resident (read once), outside the staging window: bytes (int or
    "512MiB"), a fraction of all layer bytes (0.25, "25%"), a layer count ("8L"), or "fill":
    what [memory] limit leaves after everything else (`--mem`). 0 streams every layer. See
    `parse_budget`."""

    def __attrs_post_init__(self) -> None:
        _check(self.mode in MODES, "mode", self.mode, "one of " + ", ".join(repr(m) for m in MODES))
        _check(_is_int(self.queue_depth) and self.queue_depth >= 1, "queue_depth", self.queue_depth,
               "an integer >= 1")
        _check(_is_int(self.chunk_bytes) and self.chunk_bytes >= PAGE_BYTES and self.chunk_bytes % PAGE_BYTES == 0,
               "chunk_bytes", self.chunk_bytes, f"a positive multiple of {PAGE_BYTES}")
        _check(_is_int(self.window_layers) and self.window_layers >= 1, "window_layers", self.window_layers,
               "an integer >= 1")
        _check(_is_number(self.bandwidth_cap_bytes_per_s) and (self.bandwidth_cap_bytes_per_s == 0 or
               MIN_CAP_BYTES_PER_S <= self.bandwidth_cap_bytes_per_s < math.inf), "bandwidth_cap_bytes_per_s",
               self.bandwidth_cap_bytes_per_s, f"0 (no cap) or at least {MIN_CAP_BYTES_PER_S:.0e}")
        _check(_is_number(self.read_latency_ms) and 0 <= self.read_latency_ms <= MAX_LATENCY_MS, "read_latency_ms",
               self.read_latency_ms, f"a number in [0, {MAX_LATENCY_MS:.0f}]")
        _check(_is_int(self.read_retries) and 0 <= self.read_retries <= 10, "read_retries", self.read_retries,
               "an integer from 0 to 10")
        parse_budget(self.dram_budget)
