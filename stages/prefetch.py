"""Prefetch: streams the target's non-resident layers from flash, in execution order, pass after pass.

It owns the staging window (the flash store's buffer pool): for each streamed layer it takes a
free buffer, reads the layer's chunks with up to `queue_depth` reads in flight (worker threads;
the reads release the GIL), and sends the layer to PrunedVerify. Buffers come back as
`FreeBuffer` messages once their layer is computed, so the window bounds how far ahead it runs:
while the current pass computes its last layers, the next pass's first layers are already
being read. It ends when its consumer goes away.
"""

from __future__ import annotations

import itertools
import time
from functools import partial

import anyio
import attrs

from lever.backends.cpu.layer import LayerWeights, load_layer
from lever.backends.flash import FlashStore
from lever.dataflow.graph import Stage
from lever.dataflow.messages import FreeBuffer, LayerMessage, PassLayers, StreamedLayer
from lever.dataflow.trace import Tracer
from lever.gguf.file import GGUFFile
from lever.gguf.spec import ModelSpec


async def read_all(store: FlashStore, layer: int, buffer, limiter: anyio.CapacityLimiter) -> None:
    """All chunks of one layer into `buffer`, up to the limiter's count in flight."""
    async with anyio.create_task_group() as tg:
        for r in store.plan_reads(layer):
            tg.start_soon(partial(anyio.to_thread.run_sync, store.read, r, buffer, limiter=limiter))


@attrs.define
class Prefetch(Stage):
    """FreeBuffer -> PassLayers then its StreamedLayers, pass after pass, forever (until
    PrunedVerify stops listening). Each pass streams the store's streamed layers of the moment it
    begins: a live memory budget changes them between passes (lever.pipelines.residency)."""

    name: str
    store: FlashStore
    file: GGUFFile
    spec: ModelSpec
    io_limiter: anyio.CapacityLimiter  # reads in flight: the flash queue depth
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))
    INPUTS = {"free": FreeBuffer}
    OUTPUTS = {"layers": LayerMessage}
    OPTIONAL = frozenset({"free", "layers"})

    def read_layer(self, layer: int, buffer) -> LayerWeights:
        """Synchronous: one layer into one buffer, chunk after chunk (tests and simple callers)."""
        return load_layer(self.file, self.spec, layer, raws=self.store.read_layer(layer, buffer))

    async def _read(self, layer: int, buffer) -> LayerWeights:
        await read_all(self.store, layer, buffer, self.io_limiter)
        return load_layer(self.file, self.spec, layer, raws=self.store.tensors(layer, buffer))

    async def run(self, inputs, outputs):
        pool = self.store.pool
        buffers: list = []  # the window, taken at the first layer streamed (a run all resident takes none)
        free: list[int] = []
        holding: dict[int, int] = {}  # buffer id -> layer it holds
        try:
            for pass_id in itertools.count():
                streamed = self.store.streamed  # fixed for the pass; a pass with none still says so
                try:
                    await outputs["layers"].send(PassLayers(pass_id, streamed))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return
                for layer in streamed:
                    if not buffers:
                        buffers = [pool.acquire() for _ in range(pool.n_buffers)]
                        free = list(range(len(buffers)))
                    while not free:
                        try:
                            msg = await inputs["free"].receive()
                        except (anyio.EndOfStream, anyio.ClosedResourceError):
                            return
                        self.store.release_layer(holding.pop(msg.buffer_id))
                        free.append(msg.buffer_id)
                    buf_id = free.pop(0)
                    buf = buffers[buf_id]
                    n_bytes = sum(r.n_bytes for r in self.store.plan_reads(layer))
                    t0 = time.perf_counter()
                    with self.tracer.span(self.name, f"read p{pass_id} L{layer}", kind="io", n_bytes=n_bytes):
                        weights = await self._read(layer, buf)
                    read_s = time.perf_counter() - t0
                    holding[buf_id] = layer
                    try:
                        await outputs["layers"].send(StreamedLayer(pass_id, layer, weights, buf_id, n_bytes, read_s))
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        return
        finally:
            for b in buffers:
                pool.release(b)
