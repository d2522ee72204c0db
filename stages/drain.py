"""Drain: Prefetch's consumer when a pass reads and computes nothing, for timing flash alone.

`lever profile` times a pass's reads with no compute (lever.pipelines.compose.read_pass_s):
Prefetch streams the layers as in a real run, and Drain hands each buffer straight back,
noting when each pass's last layer arrived, so the read-only pass is scheduled as a real one.
"""

from __future__ import annotations

import time

import attrs

from lever.dataflow.graph import Stage
from lever.dataflow.messages import FreeBuffer, LayerMessage, StreamedLayer


@attrs.define
class Drain(Stage):
    """Prefetch's consumer with no compute: hands each streamed buffer straight back, and
    notes the time each pass's last layer arrived, so a read-only pass is timed as scheduled
    in a real run."""

    name: str
    n_layers: int  # layers to take before closing
    per_pass: int  # streamed layers in one pass
    ends: list[float] = attrs.field(factory=list)  # perf_counter() at the last layer of each pass
    INPUTS = {"layers": LayerMessage}
    OUTPUTS = {"free": FreeBuffer}

    async def run(self, inputs, outputs):
        i = 0
        while i < self.n_layers:
            msg = await inputs["layers"].receive()
            if not isinstance(msg, StreamedLayer):
                continue  # a pass's plan: the layers follow
            i += 1
            if i % self.per_pass == 0:
                self.ends.append(time.perf_counter())
            await outputs["free"].send(FreeBuffer(msg.buffer_id))
