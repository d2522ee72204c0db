"""The flash store's file: its descriptor (and mapping, in mmap mode), every transfer from it.

Below the flash store (store.py), which plans the reads and holds the layers: this moves bytes
from the file into buffers, three ways by FlashConfig.mode (store.py's docstring says which and
why), retries what is worth retrying (RETRIED, with a backoff), checks after every read that the
file is the one opened, and keeps the page cache from quietly holding the model
(`drop_range`, `evict`). Every error names the file, the layer or tensor, and the offset.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import sys
import time
from collections.abc import Iterable
from functools import partial

import numpy as np

from lever.errors import LeverError

from .config import PAGE_BYTES, FlashConfig
from .faults import Faults
from .layout import Read, round_down, round_up
from .pool import StagingBuffer

# The largest page-cache folio: a PMD (2 MiB with 4 KiB pages, on x86-64 and arm64).
FOLIO_MAX_BYTES = 2 * 2**20
# Python 3.11's mmap module lacks the name; 22 is its value on every Linux ABI we run on.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)
RETRIED = frozenset({errno.EAGAIN, errno.EIO})
# Long enough for a link reset or a controller's busy spell to pass, short enough that a
# persistent error still ends the run well within a second.
RETRY_BACKOFF_S = 0.02


class FileReader:
    """One open GGUF file, read by planned reads and spans. Close it when done (idempotent)."""

    def __init__(self, path, config: FlashConfig, faults: Faults | None = None):
        self.path, self.config, self.faults = path, config, faults
        self.map: mmap.mmap | None = None
        self._populate_read = MADV_POPULATE_READ
        self.fd = -1
        self.fd = self._open()
        try:
            st = os.fstat(self.fd)
            self._identity = (st.st_ino, st.st_size, st.st_mtime_ns)
            if config.mode == "mmap":
                self.map = mmap.mmap(self.fd, st.st_size, access=mmap.ACCESS_READ)
                # No readahead on faults: each chunk asks for exactly its pages (MADV_WILLNEED), and
                # the kernel's guesses would pull in neighbours - often resident or not yet due.
                self.map.madvise(mmap.MADV_RANDOM)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def _open(self) -> int:
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if self.config.mode == "direct":
            flags |= os.O_DIRECT
        try:
            return os.open(self.path, flags)
        except OSError as e:
            if e.errno == errno.EINVAL and self.config.mode == "direct":
                raise LeverError(f"{self.path}: the file system does not support O_DIRECT (tmpfs?); "
                                 f"use flash mode 'mmap'") from None
            raise LeverError(f"{self.path}: cannot open: {e.strerror}") from None

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read(self, r: Read, buffer: StagingBuffer, n: int) -> None:
        """Planned read `r` (the store's read number `n`, for the faults) into `buffer`."""
        if self.map is None:
            self._pread(r, buffer, n)
        else:
            self._copy_from_map(r, buffer, n)
        self.check_unchanged(f"layer {r.layer}", r.file_offset)

    def _transfer(self, do, where: str, offset: int, n_bytes: int, n: int | None = None) -> int:
        """One transfer (`do()`: the syscall, returning bytes moved) of read `n` (None: not
        a layer's, no faults), retried on the errors worth retrying (see the module docstring)."""
        for attempt in itertools.count(1):
            try:
                return self.faults.transfer(n, do) if self.faults is not None and n is not None else do()
            except OSError as e:
                if e.errno not in RETRIED or attempt > self.config.read_retries:
                    tries = f" after {attempt} attempts" if attempt > 1 else ""
                    raise LeverError(f"{self.path}: {where}, offset {offset}: read of {n_bytes} bytes failed "
                                     f"({e.strerror or e}){tries}{self.changed_note()}") from e
            time.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))

    def _pread(self, r: Read, buffer: StagingBuffer, n: int) -> None:
        dest = buffer.array[r.buffer_offset : r.buffer_offset + r.n_bytes]
        got = 0
        while got < r.need_bytes:
            at = r.file_offset + got
            moved = self._transfer(partial(os.preadv, self.fd, [dest[got:]], at), f"layer {r.layer}", at,
                                   r.n_bytes - got, n)
            got += max(moved, 0)
            # A transfer that is not a whole number of pages stopped at the end of the file;
            # O_DIRECT could not continue from there anyway.
            if moved <= 0 or got % PAGE_BYTES:
                break
        if got < r.need_bytes:
            raise self._error(r, f"short read: {got} of {r.need_bytes} bytes{self.changed_note()}", r.file_offset)

    def _copy_from_map(self, r: Read, buffer: StagingBuffer, n: int) -> None:
        start, need = r.file_offset, r.need_bytes
        if os.fstat(self.fd).st_size < start + need:  # say so before madvise fails with EFAULT
            raise self._error(r, f"short read: file ends before {start + need}{self.changed_note()}", start)
        span = round_up(need)

        def fault_in() -> int:
            self.map.madvise(mmap.MADV_WILLNEED, start, span)
            if self._populate_read is not None:
                self._populate(start, span)
            return span

        where = f"layer {r.layer}"
        got = self._transfer(fault_in, where, start, need, n)
        if got >= need:  # the copy, from the pages just faulted in
            dest, got, moved = buffer.array[r.buffer_offset : r.buffer_offset + need], 0, 1
            while got < need and moved > 0:
                moved = self._transfer(partial(os.preadv, self.fd, [dest[got:]], start + got), where, start + got,
                                       need - got)
                got += moved
        if got < need:
            raise self._error(r, f"short read: {got} of {need} bytes{self.changed_note()}", start)
        # The copy is what compute uses; holding the pages too would double the DRAM.
        self.drop_range(start, span)

    def _populate(self, start: int, span: int) -> None:
        try:
            self.map.madvise(self._populate_read, start, span)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._populate_read = None  # kernel < 5.14: the copy's own faults do the reading

    def read_span(self, where: str, start: int, n_bytes: int, dest: np.ndarray | None = None) -> np.ndarray:
        """[start, start + n_bytes) of the file, as a view into `dest` (page-aligned, large
        enough) or fresh anonymous memory (O_DIRECT's rule: aligned offsets, lengths, buffers)."""
        first = round_down(start)
        span = round_up(start + n_bytes) - first
        dest = np.frombuffer(mmap.mmap(-1, span), np.uint8) if dest is None else dest[:span]
        got = 0
        while got < span:
            at = first + got
            moved = self._transfer(partial(os.preadv, self.fd, [dest[got:]], at), where, at, span - got)
            got += max(moved, 0)
            if moved <= 0 or got % PAGE_BYTES:
                break
        if got < start - first + n_bytes:
            raise LeverError(f"{self.path}: {where}, offset {start}: short read: {max(got - (start - first), 0)} "
                             f"of {n_bytes} bytes{self.changed_note()}")
        if self.map is not None:
            self.drop_range(first, span)  # mmap mode's fd is buffered: keep the page cache clean
        return dest[start - first : start - first + n_bytes]

    def drop_range(self, start: int, n_bytes: int) -> None:
        if self.fd < 0:
            return
        if self.map is not None:
            # Unmap first: the page cache will not evict a page some mapping still holds.
            self.map.madvise(mmap.MADV_DONTNEED, start, min(n_bytes, round_up(len(self.map)) - start))
        os.posix_fadvise(self.fd, start, n_bytes, os.POSIX_FADV_DONTNEED)

    def check_unchanged(self, where: str, offset: int) -> None:
        st = os.fstat(self.fd)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != self._identity:
            raise LeverError(f"{self.path}: {where}, offset {offset}: file changed while open{self.changed_note()}")

    def changed_note(self) -> str:
        size = os.fstat(self.fd).st_size
        if size != self._identity[1]:
            return f" (file is now {size} bytes, was {self._identity[1]}: truncated or replaced while open)"
        return ""

    def _error(self, r: Read, what: str, offset: int) -> LeverError:
        return LeverError(f"{self.path}: layer {r.layer}, offset {offset}: {what}")

    def evict(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Drops [start, end) byte ranges from the page cache. The kernel evicts only folios wholly
        inside a range, and a file read normally is cached in folios of up to FOLIO_MAX_BYTES; so
        each range is widened to that grain (costing at most a re-read of a neighbour's edge) or
        its ends stay cached."""
        for start, end in ranges:
            lo = round_down(start, FOLIO_MAX_BYTES)
            os.posix_fadvise(self.fd, lo, round_up(end, FOLIO_MAX_BYTES) - lo, os.POSIX_FADV_DONTNEED)
