"""Drain: every streamed buffer goes straight back, and each pass's end is noted."""

from __future__ import annotations

import anyio

from lever.dataflow.graph import Pipeline
from lever.dataflow.messages import FreeBuffer, LayerMessage, PassLayers, StreamedLayer
from lever.stages.drain import Drain
from lever.stages.testing import Sink, Source


def test_each_buffer_goes_back_and_each_pass_end_is_noted():
    layers = [StreamedLayer(pass_id=i // 3, layer=i % 3, weights=None, buffer_id=i % 2, n_bytes=10) for i in range(6)]
    layers[3:3] = [PassLayers(1, (0, 1, 2))]  # each pass's plan comes first, and is no layer
    layers[0:0] = [PassLayers(0, (0, 1, 2))]
    src, drain, sink = Source.of(LayerMessage)("src", layers), Drain("drain", 6, per_pass=3), Sink.of(FreeBuffer)("s")
    p = Pipeline("read-only").connect(src, "out", drain, "layers", 2).connect(drain, "free", sink, "inp", 1)
    anyio.run(p.run)
    assert [f.buffer_id for f in sink.got] == [0, 1, 0, 1, 0, 1]
    assert len(drain.ends) == 2 and drain.ends[0] <= drain.ends[1]
