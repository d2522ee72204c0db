"""The dataflow graph: stages with typed ports, joined by bounded channels, run as one task group.

A pipeline is built first and run second. `Pipeline.connect` joins an output port to an input
port through an anyio memory object stream of a small fixed capacity; `build` checks every
connection's message type, that no port dangles, and that every cycle holds at least one
buffered channel (a cycle of rendezvous channels could never start). `run` starts every stage
in one task group: closing is the protocol (a stage ends when its inputs close and then its
outputs close), an exception in any stage cancels the others and reaches the caller as the
original exception with the stage's name in a note. The overlap of flash reads and compute
comes from here: a stage blocked on a full channel waits while the others run. Each run keeps
per-channel figures (`channel_stats`: messages sent, the most ever waiting), `tap` lets an
observer see the messages of an output port as they are sent, and `to_mermaid`
draws the graph as built, which is how the README's picture of the pipeline is made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any, ClassVar

import anyio
import attrs
from anyio.abc import ObjectReceiveStream, ObjectSendStream


class GraphError(Exception):
    """A pipeline that cannot be built: the message names the ports at fault."""


class Stage:
    """Base of every stage. Subclasses are attrs classes that declare their ports:

        INPUTS = {"tokens": TokenBatch}; OUTPUTS = {"hidden": Hidden}

    and implement `async def run(self, inputs, outputs)`, receiving from `inputs[name]` and
    sending to `outputs[name]` (only the ports that are connected appear). The work itself is a
    plain synchronous method that tests call without an event loop.
    """

    INPUTS: ClassVar[Mapping[str, type]] = {}
    OUTPUTS: ClassVar[Mapping[str, type]] = {}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()  # ports that may stay unconnected

    name: str

    async def run(self, inputs: dict[str, ObjectReceiveStream], outputs: dict[str, ObjectSendStream]) -> None:
        raise NotImplementedError


@attrs.frozen
class Edge:
    src: Stage
    src_port: str
    dst: Stage
    dst_port: str
    capacity: int

    def describe(self) -> str:
        return f"{self.src.name}.{self.src_port} -> {self.dst.name}.{self.dst_port}"


@attrs.define
class ChannelStats:
    """One channel's traffic over a run."""

    capacity: int
    sent: int = 0  # messages through it
    peak_waiting: int = 0  # the most messages ever buffered at once (at most capacity)
    full_waits: int = 0  # sends that found the channel full and waited: where backpressure acted


class _CountedSend:
    """A send stream that keeps its channel's ChannelStats (anyio's own statistics() only says
    what is buffered now, which at the end of a run is nothing)."""

    def __init__(self, stream: ObjectSendStream, stats: ChannelStats, taps: list[Callable[[Any], None]] = ()):
        self._stream, self._stats, self._taps = stream, stats, taps

    async def send(self, item: Any) -> None:
        st = self._stats
        if self._stream.statistics().current_buffer_used >= st.capacity:
            st.full_waits += 1
        await self._stream.send(item)
        st.sent += 1
        st.peak_waiting = max(st.peak_waiting, self._stream.statistics().current_buffer_used)
        for tap in self._taps:
            tap(item)

    def __enter__(self):
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        return self._stream.__exit__(*exc)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class Pipeline:
    def __init__(self, name: str = "pipeline"):
        self.name = name
        self.stages: list[Stage] = []
        self.edges: list[Edge] = []
        self.channel_stats: dict[str, ChannelStats] = {}  # edge.describe() -> its figures, from the last run
        self.taps: dict[tuple[str, str], list[Callable[[Any], None]]] = {}  # (stage, output port) -> observers
        self._built = False

    def add(self, *stages: Stage) -> Pipeline:
        for s in stages:
            if any(s.name == t.name for t in self.stages):
                raise GraphError(f"two stages named {s.name!r}")
            self.stages.append(s)
        return self

    def connect(self, src: Stage, src_port: str, dst: Stage, dst_port: str, capacity: int = 1) -> Pipeline:
        if capacity < 0:
            raise GraphError(f"{src.name}.{src_port} -> {dst.name}.{dst_port}: capacity must be >= 0")
        for s in (src, dst):
            if s not in self.stages:
                self.add(s)
        self.edges.append(Edge(src, src_port, dst, dst_port, capacity))
        return self

    def tap(self, stage: Stage, port: str, fn: Callable[[Any], None]) -> Pipeline:
        """Calls fn(message) after each message `stage` sends on `port`: an observer (a live
        page) that sees the run without any stage knowing. It runs on the sender's task, so it
        must be quick and must not block; an exception in it is the sender's."""
        if port not in stage.OUTPUTS:
            raise GraphError(f"{stage.name}.{port}: no such output to tap")
        self.taps.setdefault((stage.name, port), []).append(fn)
        return self

    def build(self) -> Pipeline:
        """Checks the graph; raises GraphError naming both ports of the first fault."""
        used_out: dict[tuple[str, str], Edge] = {}
        used_in: dict[tuple[str, str], Edge] = {}
        for e in self.edges:
            if e.src_port not in type(e.src).OUTPUTS:
                raise GraphError(f"{e.describe()}: {e.src.name} has no output port {e.src_port!r}")
            if e.dst_port not in type(e.dst).INPUTS:
                raise GraphError(f"{e.describe()}: {e.dst.name} has no input port {e.dst_port!r}")
            sent, wanted = type(e.src).OUTPUTS[e.src_port], type(e.dst).INPUTS[e.dst_port]
            if not issubclass(sent, wanted):
                raise GraphError(f"{e.describe()}: sends {sent.__name__}, receives {wanted.__name__}")
            for key, used in (((e.src.name, e.src_port), used_out), ((e.dst.name, e.dst_port), used_in)):
                if key in used:
                    raise GraphError(f"{e.describe()}: port {key[0]}.{key[1]} is already connected "
                                     f"({used[key].describe()})")
                used[key] = e
        for s in self.stages:
            for port in type(s).INPUTS:
                if (s.name, port) not in used_in and port not in type(s).OPTIONAL:
                    raise GraphError(f"dangling input port {s.name}.{port}: nothing sends to it")
            for port in type(s).OUTPUTS:
                if (s.name, port) not in used_out and port not in type(s).OPTIONAL:
                    raise GraphError(f"dangling output port {s.name}.{port}: nothing receives from it")
        self._check_cycles()
        self._built = True
        return self

    def _check_cycles(self) -> None:
        """Every cycle of rendezvous (capacity 0) edges alone would deadlock at start."""
        zero = [e for e in self.edges if e.capacity == 0]
        nxt: dict[str, list[Edge]] = {}
        for e in zero:
            nxt.setdefault(e.src.name, []).append(e)
        state: dict[str, int] = {}

        def visit(node: str, path: list[Edge]) -> None:
            state[node] = 1
            for e in nxt.get(node, []):
                if state.get(e.dst.name) == 1:
                    start = next((i for i, p in enumerate(path) if p.src.name == e.dst.name), 0)
                    cycle = path[start:] + [e]
                    raise GraphError("cycle without a buffered channel: " + ", ".join(p.describe() for p in cycle))
                if e.dst.name not in state:
                    visit(e.dst.name, path + [e])
            state[node] = 2

        for s in self.stages:
            if s.name not in state:
                visit(s.name, [])

    def to_mermaid(self) -> str:
        """The graph as a Mermaid flowchart: a node per stage (name and class), an arrow per
        channel labelled with its ports, message type and capacity."""
        lines = ["flowchart LR"]
        for s in self.stages:
            lines.append(f'    {_node_id(s.name)}["{s.name}<br/><i>{type(s).__name__}</i>"]')
        for e in self.edges:
            kind = type(e.src).OUTPUTS.get(e.src_port, object).__name__
            label = f"{e.src_port} → {e.dst_port}<br/>{kind} ×{e.capacity}" if e.src_port != e.dst_port \
                else f"{e.src_port}<br/>{kind} ×{e.capacity}"
            lines.append(f'    {_node_id(e.src.name)} -->|"{label}"| {_node_id(e.dst.name)}')
        return "\n".join(lines)

    async def run(self) -> None:
        if not self._built:
            self.build()
        inputs: dict[str, dict[str, ObjectReceiveStream]] = {s.name: {} for s in self.stages}
        outputs: dict[str, dict[str, ObjectSendStream]] = {s.name: {} for s in self.stages}
        self.channel_stats = {}
        for e in self.edges:
            send, recv = anyio.create_memory_object_stream[Any](max_buffer_size=e.capacity)
            stats = self.channel_stats[e.describe()] = ChannelStats(e.capacity)
            outputs[e.src.name][e.src_port] = _CountedSend(send, stats, self.taps.get((e.src.name, e.src_port), []))
            inputs[e.dst.name][e.dst_port] = recv
        try:
            async with anyio.create_task_group() as tg:
                for s in self.stages:
                    tg.start_soon(_run_stage, s, inputs[s.name], outputs[s.name], name=s.name)
        except BaseExceptionGroup as group:
            raise _first_cause(group) from None


def _node_id(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


async def _run_stage(stage: Stage, inputs: dict, outputs: dict) -> None:
    async with AsyncExitStack() as stack:
        for stream in list(inputs.values()) + list(outputs.values()):
            stack.enter_context(stream)  # closing our ends tells neighbours we are done
        try:
            await stage.run(inputs, outputs)
        except BaseException as e:
            # A stage's own task group wraps its failure in a group: name the failure itself.
            cause = _first_cause(e) if isinstance(e, BaseExceptionGroup) else e
            if isinstance(cause, anyio.get_cancelled_exc_class()):
                raise
            cause.add_note(f"in stage {stage.name!r} ({type(stage).__name__})")
            if cause is e:
                raise
            raise cause from None


def _first_cause(group: BaseExceptionGroup) -> BaseException:
    """The failure that started it out of the task group: not the cancellations it caused, and
    not a neighbour's EndOfStream or BrokenResourceError from the failed stage closing its ends
    (a signal landing in Prefetch reaches Verify first as a closed channel)."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves = list(_leaves(group))
    consequences = (cancelled, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)
    for wanted in (lambda e: not isinstance(e, Exception) and not isinstance(e, cancelled),  # a signal, an exit
                   lambda e: not isinstance(e, consequences),
                   lambda e: not isinstance(e, cancelled)):
        for exc in leaves:
            if wanted(exc):
                return exc
    return leaves[0]


def _leaves(group: BaseExceptionGroup):
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
