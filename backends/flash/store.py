"""The flash store: the target model's layers read from the GGUF file on every forward pass.

It sits under the pipeline's read stage. At open it decides which layers stay resident (read
once, kept in DRAM) and plans every read of the rest; the stage then, for each streamed layer,
acquires a buffer of the staging window (`pool`), runs the layer's `plan_reads` through
`read` in worker threads (at most `queue_depth` at once; the reads release the GIL), passes
`tensors(layer, buffer)` to compute, and afterwards calls `release_layer` and gives the buffer
back. Everything here is synchronous and thread-safe; the scheduling is the stage's.

Three ways to read, chosen by FlashConfig.mode:

- direct: O_DIRECT preadv into the page-aligned buffer. The page cache is bypassed, so each
  pass reads the device, and a device error is an errno we can report.
- mmap: the file is mapped, and each chunk is faulted in (MADV_WILLNEED to issue one large
  read, MADV_POPULATE_READ to wait for it and surface I/O errors as errno instead of SIGBUS),
  copied into the buffer, and dropped from the mapping and the page cache at once. The copy
  (several times faster than phone flash, and on a worker thread) is a pread from the pages
  just faulted in rather than a memcpy from the mapping - the same one copy, but a file
  truncated meanwhile gives a short read instead of SIGBUS - and buys
  what zero-copy views of the mapping cannot give: the same bounded staging window and
  buffer protocol as direct mode, a page cache that never holds more than the chunks in
  flight, and no view that, used after its layer was released, silently faults the pages back
  in from flash.
- cached: buffered preadv, the pages left in the page cache: the kernel's LRU is a block cache
  over the streamed layers. Not for a phone's runs: a pass scans the layers in one cyclic
  order, and an LRU smaller than the scan evicts each block before its next use, so it hits
  nothing (docs/measurements.md, 'Static residency against an LRU block cache'); it is there
  to measure that against static residency under the same cap.

What is retried, and what ends the run (every error names the file, the layer and the offset):

- EINTR: retried at once, by Python itself (PEP 475) - a signal is not a device fault.
- EAGAIN and EIO: retried up to `read_retries` times (default 1) after a short backoff, at
  the offset where the transfer stopped. EAGAIN says "try again"; an EIO from flash usually
  means the controller already gave up after its own ECC retries, but a cable, a link reset
  or a card reader can fail once and then read fine, and a read-only retry costs one read
  and can corrupt nothing. A second failure ends the run.
- A transfer of whole pages but fewer than asked: continued from where it stopped (legal
  for any device). End-of-file or a transfer stopping mid-page where the file should have
  data: a short read, an error (the file was truncated, or the device lies).
- The file changed since open (size or mtime, checked after every read): an error, never
  retried - the bytes may be from another model, and using them would be silent corruption.
  A file renamed over the path is not a change: the descriptor keeps the file that was
  opened and checked, and the run goes on reading it.
- A slow read (latency spike) is waited for: there is no timeout, since a read cannot be
  interrupted from user space (the thread would stay stuck in the kernel anyway), and a
  Ctrl-C waits only for the reads in flight.

Faults (faults.py) can be injected between the store and its file, for the tests.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time

import numpy as np

from lever.errors import LeverError
from lever.gguf.file import GGUFFile

from .config import PAGE_BYTES, FlashConfig, plan_residency
from .device import Counters, FlashStats, Throttle
from .faults import Faults, active
from .layout import LayerExtent, Read, layer_extents, plan_chunks, round_up
from .pool import BufferPool, StagingBuffer
from .reader import FileReader


class FlashStore:
    """Streamed and resident layers of one GGUF file. Close it (or use `with`)."""

    def __init__(self, path: str | os.PathLike, config: FlashConfig | None = None, *, file: GGUFFile | None = None,
                 faults: Faults | None = None, resident: frozenset[int] | None = None):
        """`resident`: the layers kept in DRAM, when the caller planned them already (a run's
        RunPlan); else planned here from `config.dram_budget`."""
        self.config = config = config or FlashConfig()
        self.faults = faults if faults is not None else active()
        self.file = file or GGUFFile(path)
        self.path = self.file.path
        self.extents: list[LayerExtent] = layer_extents(self.file)
        self.resident: frozenset[int] = plan_residency(self.layer_bytes, config.dram_budget) if resident is None \
            else frozenset(resident)
        # both as planned at open; a run's Residency keeps them in step with the layers it holds
        self.streamed: tuple[int, ...] = tuple(i for i in range(self.n_layer) if i not in self.resident)
        self._plans = [plan_chunks(e, config.chunk_bytes) for e in self.extents]
        self._throttle = Throttle(config.bandwidth_cap_bytes_per_s, config.read_latency_ms)
        self._counters = Counters()
        self._resident_bufs: dict[int, StagingBuffer] = {}
        self._resident_lock = threading.Lock()
        self._read_no = itertools.count()  # numbers reads for the faults; next() on it is atomic
        self.pool: BufferPool | None = None
        self.reader = FileReader(self.path, config, self.faults)
        try:
            # A file just written or read sits in the page cache; evicting the streamed ranges
            # makes the first pass read the device like every later one.
            self.reader.evict((run.file_start, run.file_end) for i in self.streamed for run in self.extents[i].runs)
            # sized for any layer, not only those streamed at open: a live memory budget may stream
            # any of them later (lever.pipelines.residency); a buffer's pages cost nothing until read into
            self.pool = BufferPool(config.window_layers, max((e.buffer_bytes for e in self.extents), default=0))
        except BaseException:
            self.close()
            raise
        self._counters.reset()
        if self.faults is not None:
            self.faults.attach(self)

    def close(self) -> None:
        """Close the file and free the window and resident layers; views handed out keep
        their memory alive until dropped. Idempotent."""
        if self.pool is not None:
            self.pool.close()
        for buf in self._resident_bufs.values():
            buf.close()
        self._resident_bufs = {}
        self.reader.close()

    def __enter__(self) -> FlashStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the layer table

    @property
    def n_layer(self) -> int:
        return len(self.extents)

    @property
    def layer_bytes(self) -> list[int]:
        """DRAM each layer takes in a buffer (its runs, page-rounded)."""
        return [e.buffer_bytes for e in self.extents]

    @property
    def streamed_bytes(self) -> int:
        """Bytes one pass asks of storage: every streamed layer's reads."""
        return sum(r.n_bytes for i in self.streamed for r in self._plans[i])

    def plan_reads(self, layer: int) -> list[Read]:
        """The reads that fill a buffer with `layer`, in file order; any order and any
        concurrency will do, as each writes its own part of the buffer."""
        return list(self._plans[self._layer_index(layer)])

    def _layer_index(self, layer: int) -> int:
        if not 0 <= layer < self.n_layer:
            raise LeverError(f"{self.path}: no layer {layer} (the file has {self.n_layer})")
        return layer

    # -- reading

    def read(self, r: Read, buffer: StagingBuffer) -> None:
        """Perform one planned read into `buffer`; raises LeverError naming file, layer and
        offset on a device error, a short read or a file changed since open."""
        if self.reader.closed:
            raise LeverError(f"{self.path}: flash store is closed")
        if r.buffer_offset + r.n_bytes > buffer.n_bytes:
            raise LeverError(f"{self.path}: layer {r.layer} needs {self.extents[r.layer].buffer_bytes} bytes, "
                             f"buffer {buffer.index} has {buffer.n_bytes}")
        n = next(self._read_no)
        if self.faults is not None:
            self.faults.before_read(n, r, self.path)
        buffer.begin(r.layer, r.index)
        deadline = self._throttle.deadline(r.n_bytes) if self._throttle.active else 0.0
        t0 = time.perf_counter()
        self.reader.read(r, buffer, n)
        if deadline:
            Throttle.wait_until(deadline)
        self._counters.add(r.n_bytes, r.data_bytes, time.perf_counter() - t0)
        buffer.landed(r.layer, r.index)

    def read_layer(self, layer: int, buffer: StagingBuffer) -> dict[str, np.ndarray]:
        """Read a whole layer into `buffer`, one chunk after another; its tensor views."""
        for r in self._plans[self._layer_index(layer)]:
            self.read(r, buffer)
        return self.tensors(layer, buffer)

    def tensors(self, layer: int, buffer: StagingBuffer) -> dict[str, np.ndarray]:
        """Tensor name -> (n_rows, row_bytes) uint8 view into `buffer`, once every read of
        the layer has landed there (never a partly filled buffer)."""
        extent = self.extents[self._layer_index(layer)]
        if not buffer.complete(layer, len(self._plans[layer])):
            raise LeverError(f"{self.path}: layer {layer}: buffer {buffer.index} does not hold the whole layer "
                             "(a read failed or is still in flight)")
        views = {}
        for t, offset in extent.placed:
            flat = buffer.array[offset : offset + t.n_bytes]
            views[t.name] = flat.reshape(t.n_rows, t.n_bytes // t.n_rows)
        return views

    def release_layer(self, layer: int) -> None:
        """Drop a streamed layer's pages from the mapping (mmap mode) and the page cache, so
        the cache cannot quietly come to hold the model (cached mode keeps them: there the
        page cache is the block cache measured). The buffer goes back to the pool separately."""
        if self.config.mode == "cached":
            return
        for run in self.extents[self._layer_index(layer)].runs:
            self.reader.drop_range(run.file_start, run.n_bytes)

    # -- tensors outside the layers

    def tensor_rows(self, name: str, rows: np.ndarray | None = None) -> np.ndarray:
        """Rows of a tensor outside the layers (the output head, embeddings) read through the
        file descriptor into anonymous memory: (n, row_bytes) uint8, every row when None.

        What a run touches while it streams must not be mapped from the file: a mapped page
        of a file truncated under us kills the process (SIGBUS), where a read is an error to
        report, and a read can be checked against a file changed since open."""
        if self.reader.closed:
            raise LeverError(f"{self.path}: flash store is closed")
        info = self.file.tensor(name)
        row_bytes = info.n_bytes // info.n_rows
        if rows is None:
            out = self.reader.read_span(f"tensor {name}", info.offset, info.n_bytes).reshape(info.n_rows, row_bytes)
        else:
            # One page-aligned scratch for every row (each may straddle a page more than its size).
            slot = round_up(row_bytes) + PAGE_BYTES
            scratch = np.frombuffer(mmap.mmap(-1, max(len(rows), 1) * slot), np.uint8)
            out = np.empty((len(rows), row_bytes), np.uint8)
            for j, i in enumerate(np.asarray(rows, np.int64)):
                out[j] = self.reader.read_span(f"tensor {name} row {i}", info.offset + int(i) * row_bytes, row_bytes,
                                         scratch[j * slot : (j + 1) * slot])
        self.reader.check_unchanged(f"tensor {name}", info.offset)
        return out

    def tensor_span(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of a tensor outside the layers, in one read (see tensor_rows):
        (r1 - r0, row_bytes) uint8, a view of fresh anonymous memory."""
        if self.reader.closed:
            raise LeverError(f"{self.path}: flash store is closed")
        info = self.file.tensor(name)
        row_bytes = info.n_bytes // info.n_rows
        out = self.reader.read_span(f"tensor {name} rows {r0}..{r1 - 1}", info.offset + r0 * row_bytes,
                                    (r1 - r0) * row_bytes)
        self.reader.check_unchanged(f"tensor {name}", info.offset)
        return out.reshape(r1 - r0, row_bytes)

    # -- resident layers

    def resident_layer(self, layer: int) -> dict[str, np.ndarray]:
        """A resident layer's tensor views; read from flash on the first call only."""
        if layer not in self.resident:
            raise LeverError(f"{self.path}: layer {layer} is streamed, not resident "
                             f"(dram_budget={self.config.dram_budget!r})")
        with self._resident_lock:  # two first users must not both read it
            buf = self._resident_bufs.get(layer)
            if buf is None:
                buf = StagingBuffer(-1 - layer, self.extents[layer].buffer_bytes)
                self.read_layer(layer, buf)
                self._resident_bufs[layer] = buf
        return self.tensors(layer, buf)

    def drop_resident(self, layer: int) -> None:
        """Free a resident layer's buffer once its tensors have been copied out (packed into the
        tile layout): the copy is what stays. A later resident_layer reads it again."""
        with self._resident_lock:
            buf = self._resident_bufs.pop(layer, None)
        if buf is not None:
            buf.close()

    # -- counters

    def stats(self) -> FlashStats:
        return self._counters.snapshot()

    def reset_stats(self) -> None:
        self._counters.reset()
