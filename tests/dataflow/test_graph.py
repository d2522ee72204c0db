"""The dataflow graph: build-time checks, closing protocol, errors, cancellation, overlap."""

from __future__ import annotations

import threading
import time

import anyio
import attrs
import pytest

from lever.dataflow.graph import GraphError, Pipeline, Stage
from lever.dataflow.trace import Tracer
from lever.stages import testing
from tests.load import within


@attrs.frozen
class Num:
    value: int


@attrs.frozen
class Text:
    value: str


def Source(name: str, n: int) -> Stage:  # noqa: N802 (the kit's stage, for Num)
    return testing.Source.of(Num)(name, [Num(i) for i in range(n)])


@attrs.define
class Double(Stage):
    name: str
    fail_at: int | None = None
    INPUTS = {"inp": Num}
    OUTPUTS = {"out": Num}

    def step(self, x: Num) -> Num:
        if x.value == self.fail_at:
            raise ValueError(f"bad value {x.value}")
        return Num(2 * x.value)

    async def run(self, inputs, outputs):
        async for x in inputs["inp"]:
            await outputs["out"].send(self.step(x))


def Sink(name: str) -> Stage:  # noqa: N802
    return testing.Sink.of(Num)(name)


def values(sink) -> list[int]:
    return [x.value for x in sink.got]


@attrs.define
class TextSink(Stage):
    name: str
    INPUTS = {"inp": Text}

    async def run(self, inputs, outputs):
        async for _ in inputs["inp"]:
            pass


def chain(fail_at=None, n=5):
    src, dbl, sink = Source("src", n), Double("dbl", fail_at), Sink("sink")
    p = Pipeline().connect(src, "out", dbl, "inp", 1).connect(dbl, "out", sink, "inp", 1)
    return p, sink


def test_runs_and_closes_in_order():
    p, sink = chain()
    anyio.run(p.run)
    assert values(sink) == [0, 2, 4, 6, 8]


def test_type_mismatch_names_both_ports():
    p = Pipeline().connect(Source("src", 1), "out", TextSink("txt"), "inp")
    with pytest.raises(GraphError, match=r"src\.out -> txt\.inp: sends Num, receives Text"):
        p.build()


def test_dangling_port_is_an_error():
    p = Pipeline().connect(Source("src", 1), "out", Double("dbl"), "inp")
    with pytest.raises(GraphError, match=r"dangling output port dbl\.out"):
        p.build()


def test_unknown_port_is_an_error():
    p = Pipeline().connect(Source("src", 1), "nope", Sink("sink"), "inp")
    with pytest.raises(GraphError, match="src has no output port 'nope'"):
        p.build()


def test_cycle_of_rendezvous_channels_is_an_error():
    a, b = Double("a"), Double("b")
    p = Pipeline().connect(a, "out", b, "inp", capacity=0).connect(b, "out", a, "inp", capacity=0)
    with pytest.raises(GraphError, match="cycle without a buffered channel: a.out -> b.inp, b.out -> a.inp"):
        p.build()
    ok = Pipeline().connect(Double("c"), "out", Double("d"), "inp", capacity=0)
    ok.connect(ok.stages[1], "out", ok.stages[0], "inp", capacity=1)
    ok.build()


def test_stage_exception_reaches_caller_with_stage_name():
    p, _ = chain(fail_at=3)
    with pytest.raises(ValueError, match="bad value 3") as info:
        anyio.run(p.run)
    assert any("in stage 'dbl'" in n for n in info.value.__notes__)


class Signalled(BaseException):
    """As lever.signals.Interrupted, a BaseException; not KeyboardInterrupt itself, which would
    stop pytest."""


@attrs.define
class Interrupted(Stage):
    """A stage a signal lands in while its thread reads: its end of the channel is closed
    first, so its neighbour fails on the closed channel before the signal is raised here."""
    name: str
    OUTPUTS = {"out": Num}

    async def run(self, inputs, outputs):
        await outputs["out"].aclose()
        await anyio.to_thread.run_sync(time.sleep, 0.3)
        raise Signalled


@attrs.define
class Computing(Stage):
    """A stage in the middle of a thread's work when its neighbour stops: it finds the channel
    closed before the cancellation reaches it (receive_nowait is no checkpoint)."""
    name: str
    INPUTS = {"inp": Num}

    async def run(self, inputs, outputs):
        await anyio.to_thread.run_sync(time.sleep, 0.05)
        inputs["inp"].receive_nowait()


def test_a_signal_in_one_stage_is_what_reaches_the_caller_not_the_channel_it_closed():
    p = Pipeline().connect(Interrupted("prefetch"), "out", Computing("verify"), "inp", capacity=2)
    with pytest.raises(Signalled) as info:
        anyio.run(p.run)
    assert any("in stage 'prefetch'" in n for n in info.value.__notes__)


@attrs.define
class Forever(Stage):
    name: str
    OUTPUTS = {"out": Num}

    async def run(self, inputs, outputs):
        i = 0
        while True:
            await outputs["out"].send(Num(i))
            await anyio.to_thread.run_sync(time.sleep, 0.01)
            i += 1


def test_cancellation_stops_within_a_second_and_leaves_no_threads():
    before = threading.active_count()

    async def main():
        p = Pipeline().connect(Forever("f"), "out", Sink("s"), "inp")
        with anyio.move_on_after(0.3):
            await p.run()

    t0 = time.perf_counter()
    anyio.run(main)
    assert within(time.perf_counter() - t0 - 0.3, 1.0)  # stopped within a second of the timeout
    # anyio keeps idle worker threads only inside a running loop; after run() they are gone
    # (each ends on its own just after: waited for, as a loaded machine may be slow to run it)
    deadline = time.monotonic() + 30
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]


@attrs.define
class SlowSource(Stage):
    """Reads (sleeps in a worker thread) while the consumer computes: they should overlap."""

    name: str
    tracer: Tracer
    n: int
    OUTPUTS = {"out": Num}

    async def run(self, inputs, outputs):
        for i in range(self.n):
            with self.tracer.span(self.name, f"read {i}", kind="io", n_bytes=1000):
                await anyio.to_thread.run_sync(time.sleep, 0.05)
            await outputs["out"].send(Num(i))


@attrs.define
class SlowSink(Stage):
    name: str
    tracer: Tracer
    INPUTS = {"inp": Num}

    async def run(self, inputs, outputs):
        async for x in inputs["inp"]:
            with self.tracer.span(self.name, f"compute {x.value}"):
                await anyio.to_thread.run_sync(time.sleep, 0.05)


def test_bounded_channel_overlaps_io_with_compute(tmp_path):
    tracer = Tracer(keep_spans=True)
    p = Pipeline().connect(SlowSource("read", tracer, 8), "out", SlowSink("comp", tracer), "inp", capacity=2)
    anyio.run(p.run)
    s = tracer.summary()
    assert s.read_bytes == 8000
    assert s.overlap_share > 0.6  # serial would be 0; the first read cannot overlap
    tracer.write_chrome(tmp_path / "t.json")
    import json

    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert len(spans) == 16 and {e["cat"] for e in spans} == {"io", "compute"} and tracks == {"read", "comp"}


def test_channel_stats_count_every_message_and_the_backlog():
    src, dbl, sink = Source("src", 20), Double("dbl"), Sink("sink")
    p = Pipeline().connect(src, "out", dbl, "inp", 3).connect(dbl, "out", sink, "inp", 1)
    anyio.run(p.run)
    first, second = p.channel_stats["src.out -> dbl.inp"], p.channel_stats["dbl.out -> sink.inp"]
    assert first.sent == second.sent == 20 and values(sink) == [2 * i for i in range(20)]
    assert 1 <= first.peak_waiting <= 3 and second.peak_waiting <= 1
    anyio.run(p.run)  # a second run starts its figures afresh
    assert p.channel_stats["src.out -> dbl.inp"].sent == 20


def test_a_tap_sees_every_message_of_its_port_as_sent():
    src, dbl, sink = Source("src", 6), Double("dbl"), Sink("sink")
    p = Pipeline().connect(src, "out", dbl, "inp", 1).connect(dbl, "out", sink, "inp", 1)
    seen = []
    p.tap(dbl, "out", lambda m: seen.append((m.value, len(sink.got))))
    anyio.run(p.run)
    assert [v for v, _ in seen] == values(sink) == [0, 2, 4, 6, 8, 10]
    with pytest.raises(GraphError, match=r"dbl\.nope: no such output to tap"):
        p.tap(dbl, "nope", print)

    def failing(m):
        raise ValueError("the tap")
    p.tap(dbl, "out", failing)  # a tap's failure is its sender's
    with pytest.raises(ValueError, match="the tap"):
        anyio.run(p.run)


def test_to_mermaid_draws_every_stage_and_channel():
    p, _ = chain()
    text = p.to_mermaid()
    assert text.splitlines()[0] == "flowchart LR"
    assert '    src["src<br/><i>Source[Num]</i>"]' in text
    assert '    src -->|"out → inp<br/>Num ×1"| dbl' in text and '    dbl -->|"out → inp<br/>Num ×1"| sink' in text
