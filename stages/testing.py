"""A stage test kit: stages that feed a graph, collect what it sends, and drain streamed layers.

Tests of the graph, the read-only pass timing (lever.pipelines.compose.read_pass_s) and the
examples build pipelines from these rather than each defining its own toy stages, as bytewax's
`testing` module serves its dataflows. Ports are typed, so `Source.of(T)` and `Sink.of(T)` make
the stage for one message type (cached: the same type gives the same class).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import attrs

from lever.dataflow.graph import Stage
from lever.dataflow.messages import FreeBuffer, StreamedLayer


@functools.cache
def _typed(cls: type, ports: str, message_type: type) -> type:
    """cls with its one port (in `ports`, INPUTS or OUTPUTS) carrying message_type."""
    (port,) = getattr(cls, ports)
    return attrs.define(type(f"{cls.__name__}[{message_type.__name__}]", (cls,), {ports: {port: message_type}}))


@attrs.define
class Source(Stage):
    """Sends `items` on "out", in order, then closes."""

    name: str
    items: Sequence = ()
    OUTPUTS = {"out": object}

    @classmethod
    def of(cls, message_type: type) -> type[Source]:
        return _typed(cls, "OUTPUTS", message_type)

    async def run(self, inputs, outputs):
        for item in self.items:
            await outputs["out"].send(item)


@attrs.define
class Sink(Stage):
    """Keeps what arrives on "inp" in `got`, until its sender closes."""

    name: str
    got: list = attrs.field(factory=list)
    INPUTS = {"inp": object}

    @classmethod
    def of(cls, message_type: type) -> type[Sink]:
        return _typed(cls, "INPUTS", message_type)

    async def run(self, inputs, outputs):
        async for item in inputs["inp"]:
            self.got.append(item)


@attrs.define
class Drain(Stage):
    """Prefetch's consumer with no compute: hands each streamed buffer straight back, and
    notes the time each pass's last layer arrived, so a read-only pass is timed as scheduled
    in a real run."""

    name: str
    n_layers: int  # layers to take before closing
    per_pass: int  # streamed layers in one pass
    ends: list[float] = attrs.field(factory=list)  # perf_counter() at the last layer of each pass
    INPUTS = {"layers": StreamedLayer}
    OUTPUTS = {"free": FreeBuffer}

    async def run(self, inputs, outputs):
        for i in range(self.n_layers):
            msg = await inputs["layers"].receive()
            if (i + 1) % self.per_pass == 0:
                self.ends.append(time.perf_counter())
            await outputs["free"].send(FreeBuffer(msg.buffer_id))
