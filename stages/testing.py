"""A stage test kit: stages that feed a graph and collect what it sends.

Tests of the graph and the examples build pipelines from these rather than each defining its
own toy stages, as bytewax's `testing` module serves its dataflows. Ports are typed, so
`Source.of(T)` and `Sink.of(T)` make the stage for one message type (cached: the same type gives
the same class).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs

from lever.dataflow.graph import Stage


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
