"""The DRAM staging window: a fixed set of page-aligned buffers that streamed layers pass through.

The pipeline's read stage acquires a buffer, has the store read a layer's chunks into it,
hands the layer's tensor views to compute, and releases the buffer when compute is done with
them. The window is allocated once, at open, so streaming a model never allocates, and its
size (window_layers x largest streamed layer) is all the DRAM that streaming costs.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

from lever.errors import LeverError

from .config import PAGE_BYTES


class StagingBuffer:
    """One buffer of the window, and the record of which reads of which layer landed in it.

    The record is what keeps a half-read buffer from being used: the store asks `complete`
    before handing out tensor views, and a read that fails (or is still in flight) is absent.
    """

    def __init__(self, index: int, n_bytes: int):
        self.index = index
        self.n_bytes = n_bytes
        # Anonymous mmap memory starts on a page boundary, as O_DIRECT needs of its buffers.
        self._mem = mmap.mmap(-1, max(n_bytes, PAGE_BYTES))
        self.array = np.frombuffer(self._mem, np.uint8)[:n_bytes]
        self.layer: int | None = None
        self._landed: set[int] = set()
        self._lock = threading.Lock()

    def begin(self, layer: int, index: int) -> None:
        """A read of `layer`'s chunk `index` is about to overwrite its bytes."""
        with self._lock:
            if self.layer != layer:
                self.layer = layer
                self._landed = set()
            self._landed.discard(index)

    def landed(self, layer: int, index: int) -> None:
        with self._lock:
            if self.layer == layer:
                self._landed.add(index)

    def complete(self, layer: int, n_reads: int) -> bool:
        with self._lock:
            return self.layer == layer and len(self._landed) == n_reads

    def clear(self) -> None:
        with self._lock:
            self.layer = None
            self._landed = set()

    def close(self) -> None:
        self.array = None
        try:
            self._mem.close()
        except BufferError:
            pass  # tensor views still alive keep the memory; it goes when they do


class BufferPool:
    """`n_buffers` buffers of `buffer_bytes` each; `acquire` blocks while all are in use."""

    def __init__(self, n_buffers: int, buffer_bytes: int):
        self.buffer_bytes = buffer_bytes
        self._all = [StagingBuffer(i, buffer_bytes) for i in range(n_buffers)] if buffer_bytes else []
        self._free = list(reversed(self._all))
        self._cond = threading.Condition()

    @property
    def n_buffers(self) -> int:
        return len(self._all)

    @property
    def n_free(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, timeout_s: float | None = None) -> StagingBuffer:
        """A free buffer; waits up to timeout_s (None = forever, 0 = not at all)."""
        if not self._all:
            raise LeverError("flash staging window has no buffers: every layer is resident, none is streamed")
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout_s):
                raise LeverError(
                    f"flash staging window exhausted: all {len(self._all)} buffers in use after "
                    f"{timeout_s} s (window_layers={len(self._all)}); release a layer before acquiring another"
                )
            buf = self._free.pop()
        buf.clear()
        return buf

    def release(self, buf: StagingBuffer) -> None:
        with self._cond:
            if buf.index >= len(self._all) or self._all[buf.index] is not buf:
                raise ValueError(f"buffer {buf.index} does not belong to this pool")
            if buf in self._free:
                raise ValueError(f"buffer {buf.index} released twice")
            buf.clear()
            self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        for buf in self._all:
            buf.close()
