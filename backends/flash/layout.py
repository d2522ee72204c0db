"""Where each layer's bytes lie in the GGUF file, and the reads that bring them into a buffer.

The flash store plans every read once, at open, from the tensor table: a layer is one or more
runs of contiguous tensors (in practice one run), each widened to page boundaries because
O_DIRECT transfers whole aligned blocks, then cut into chunks so several reads can be in
flight. A buffer holds a layer's runs back to back at page-aligned offsets, and a tensor is a
view at its offset there.
"""

from __future__ import annotations

import re

import attrs

from lever.errors import LeverError
from lever.gguf.file import GGUFFile, TensorInfo

from .config import PAGE_BYTES

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def round_down(x: int, to: int = PAGE_BYTES) -> int:
    return x - x % to


def round_up(x: int, to: int = PAGE_BYTES) -> int:
    return -(-x // to) * to


@attrs.frozen
class Run:
    """Contiguous tensors of one layer: [data_start, data_end) in the file, read as the page
    range [file_start, file_end) and placed at `buffer_offset` of a buffer."""

    file_start: int
    data_start: int
    data_end: int
    file_end: int
    buffer_offset: int

    @property
    def n_bytes(self) -> int:
        return self.file_end - self.file_start


@attrs.frozen
class Read:
    """One chunk of one layer: `n_bytes` (a page multiple) from `file_offset` into the buffer
    at `buffer_offset`. At least `need_bytes` must arrive - the rest is page-rounding slack,
    which may lie past the end of the file."""

    layer: int
    index: int  # position in the layer's plan
    file_offset: int
    n_bytes: int
    need_bytes: int
    buffer_offset: int
    data_bytes: int  # of the run's own bytes [data_start, data_end) inside this chunk


@attrs.frozen
class LayerExtent:
    layer: int
    runs: tuple[Run, ...]
    placed: tuple[tuple[TensorInfo, int], ...]  # (tensor, its offset in a buffer), file order
    buffer_bytes: int  # what the layer occupies in a buffer (page multiple)
    tensor_bytes: int  # the tensors' own bytes, without rounding or padding


def _runs(tensors: list[TensorInfo]) -> list[Run]:
    runs: list[Run] = []
    start = end = None
    for t in tensors:
        # Tensors whose page ranges touch share a run: the padding between them is less than
        # a page, cheaper to read than to skip with a second request.
        if end is not None and round_down(t.offset) <= round_up(end):
            end = max(end, t.offset + t.n_bytes)
            continue
        if end is not None:
            runs.append(_run(start, end, runs))
        start, end = t.offset, t.offset + t.n_bytes
    if end is not None:
        runs.append(_run(start, end, runs))
    return runs


def _run(start: int, end: int, before: list[Run]) -> Run:
    offset = before[-1].buffer_offset + before[-1].n_bytes if before else 0
    return Run(round_down(start), start, end, round_up(end), offset)


def _extent(layer: int, tensors: list[TensorInfo]) -> LayerExtent:
    tensors = sorted(tensors, key=lambda t: t.offset)
    runs = _runs(tensors)
    placed = []
    for t in tensors:
        run = next(r for r in runs if r.data_start <= t.offset <= r.data_end)
        placed.append((t, run.buffer_offset + t.offset - run.file_start))
    return LayerExtent(layer, tuple(runs), tuple(placed), sum(r.n_bytes for r in runs),
                       sum(t.n_bytes for t in tensors))


def layer_extents(f: GGUFFile) -> list[LayerExtent]:
    """Every `blk.N.*` tensor grouped by layer, N = 0 .. n_layer - 1."""
    by_layer: dict[int, list[TensorInfo]] = {}
    for name, t in f.tensors.items():
        if m := _LAYER_RE.match(name):
            by_layer.setdefault(int(m[1]), []).append(t)
    n_layer = max(by_layer) + 1 if by_layer else 0
    missing = [i for i in range(n_layer) if i not in by_layer]
    if missing:
        raise LeverError(f"{f.path}: no tensors for layer {missing[0]} (blk.{missing[0]}.*)")
    if n_layer == 0:
        raise LeverError(f"{f.path}: no layer tensors (blk.N.*) to stream")
    return [_extent(i, by_layer[i]) for i in range(n_layer)]


def plan_chunks(extent: LayerExtent, chunk_bytes: int) -> tuple[Read, ...]:
    reads = []
    for run in extent.runs:
        for off in range(run.file_start, run.file_end, chunk_bytes):
            n = min(chunk_bytes, run.file_end - off)
            need = min(off + n, run.data_end) - off
            data = min(off + n, run.data_end) - max(off, run.data_start)
            reads.append(Read(extent.layer, len(reads), off, n, need, run.buffer_offset + off - run.file_start, data))
    return tuple(reads)
