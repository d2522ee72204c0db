"""Faults injected into the flash store's reads, for the tests that check a run fails cleanly.

A `Faults` object sits between a `FlashStore` and its file: the store numbers its reads
(0, 1, ... since open, resident layers included) and asks the object before each one
(`before_read`: a latency spike, the file truncated or rewritten, a test's hook) and around
each transfer (`transfer`: an EIO instead of the syscall, or fewer bytes than it moved). The
faults are those of a real device and file system, made at the one place a real one would
show, so the store's own error handling is what the tests exercise. A store takes its faults
from its `faults` argument, else from `inject`, which reaches stores that a run opens deep
inside (`run_pipeline`, the CLI). Nothing here is reachable from a config file.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs

from .layout import Read

ALWAYS = 2**31  # eio_times: the read fails however often it is tried


@attrs.define(eq=False)
class Faults:
    """What goes wrong, by read number (the store's `read` calls since open, from 0)."""

    eio_at: int | None = None
    """This read's transfer fails with EIO, as a flash controller reports an uncorrectable page."""
    eio_times: int = ALWAYS
    """How many attempts of that read fail: 1 is a transient error a retry gets past."""
    short_at: int | None = None
    """This read's first transfer reports `short_bytes` moved, whatever it moved."""
    short_bytes: int = 0
    """0 is end-of-file where data should be; a multiple of 4096 is a partial transfer, which
    a device may legally return and direct mode must continue from (mmap mode faults a chunk
    in whole or not at all, so there any short count is an error)."""
    truncate_at: int | None = None
    """Before this read the file is truncated to `truncate_to` bytes (another process's doing)."""
    truncate_to: int = 0
    rewrite_at: int | None = None
    """Before this read the file is rewritten in place: the same size, other bytes at this
    read's offset (a `cp` over it, a download resumed into it)."""
    replace_at: int | None = None
    """Before this read another file is renamed over the path (how editors and package
    managers replace files); the store's descriptor keeps the file it opened."""
    slow_every: int = 0
    """Every this-many-th read (0: none) takes `slow_s` longer: a latency spike (garbage
    collection in the flash controller, thermal throttling)."""
    slow_s: float = 0.3
    slow_from: int | None = None
    """From this read on, every read takes `slow_s` longer: a flash that stays slower (thermal
    throttling, another app reading), which a run's online estimates must follow."""
    on_read: Callable[[int, Read], None] | None = None
    """Called before each read, in the reading thread: tests act at a chosen moment."""

    fired: list[tuple[str, int, float]] = attrs.field(factory=list, init=False)
    """(fault, read number, time.monotonic()) of each fault made, for tests to time from."""
    stores: list = attrs.field(factory=list, init=False)
    """The stores opened with these faults, for tests to inspect after a run."""
    _eio_left: int = attrs.field(default=0, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def __attrs_post_init__(self) -> None:
        self._eio_left = self.eio_times

    def attach(self, store) -> None:
        self.stores.append(store)

    def _fire(self, what: str, n: int) -> None:
        with self._lock:
            self.fired.append((what, n, time.monotonic()))

    def before_read(self, n: int, r: Read, path: os.PathLike | str) -> None:
        if self.on_read is not None:
            self.on_read(n, r)
        if n == self.truncate_at:
            self._fire("truncate", n)
            os.truncate(path, self.truncate_to)
        if n == self.rewrite_at:
            self._fire("rewrite", n)
            with open(path, "r+b") as f:
                f.seek(r.file_offset)
                data = f.read(64)
                f.seek(r.file_offset)
                f.write(bytes(b ^ 0xFF for b in data))
        if n == self.replace_at:
            self._fire("replace", n)
            tmp = f"{path}.replacing"
            shutil.copyfile(path, tmp)
            os.replace(tmp, path)
        if (self.slow_every and n % self.slow_every == self.slow_every - 1) or \
                (self.slow_from is not None and n >= self.slow_from):
            self._fire("slow", n)
            time.sleep(self.slow_s)

    def transfer(self, n: int, do: Callable[[], int]) -> int:
        """One transfer of read `n`: `do()` is the real one (returns bytes moved)."""
        if n == self.eio_at:
            with self._lock:
                fail = self._eio_left > 0
                self._eio_left -= fail
            if fail:
                self._fire("eio", n)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        moved = do()
        if n == self.short_at:
            with self._lock:
                first = not any(f[0] == "short" and f[1] == n for f in self.fired)
            if first:
                self._fire("short", n)
                return min(moved, self.short_bytes)
        return moved


_active: list[Faults] = []


def active() -> Faults | None:
    """The faults `inject` set for stores opened now (None: a healthy device)."""
    return _active[-1] if _active else None


@contextmanager
def inject(faults: Faults) -> Iterator[Faults]:
    """Every FlashStore opened inside the block (without faults of its own) reads through `faults`."""
    _active.append(faults)
    try:
        yield faults
    finally:
        _active.remove(faults)
