"""Spans recorded by every stage, a Chrome/Perfetto trace, and the overlap figure.

Stages wrap each piece of work in `tracer.span(stage, what, kind=..., n_bytes=..., batch=...)`. The run
summary reads the spans back: seconds per stage, the flash bandwidth achieved, and how much of
the time spent reading was hidden under compute (the overlap that channel scheduling is for).
`--trace out.json` writes them in the Trace Event format that chrome://tracing and Perfetto open.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager

import attrs

from lever.outputs import atomic_write


@attrs.frozen
class Span:
    stage: str
    what: str
    start_s: float
    end_s: float
    kind: str  # "io" (flash reads), "compute", "pass" (a whole unit of work, waits included), or "other"
    n_bytes: int = 0
    batch: int = 0
    thread: int = 0


FOLD_SPANS = 4096  # spans held before the finished part is folded into totals (bounds memory on long runs)


class Tracer:
    """Records spans. The summary's totals are folded in as the run goes: spans that ended
    before every span still open (and so before any span yet to start) can no longer change
    a union or an overlap, so they become seconds and are dropped; a run of hours holds at
    most FOLD_SPANS spans. Only `keep_spans` (for a `--trace` file) keeps every span."""

    def __init__(self, enabled: bool = True, keep_spans: bool = False,
                 on_span: Callable[[Span], None] | None = None):
        self.enabled = enabled
        self.keep_spans = keep_spans
        self.on_span = on_span  # each span as it ends, outside the lock (a live page's timeline)
        self.t0 = time.perf_counter()
        self._spans: list[Span] = []  # every span (keep_spans), or those not folded yet
        self._pending: list[Span] = []
        self._open: dict[int, float] = {}  # id of a span under way -> its start
        self._folded = _Totals()
        self._read_bytes = 0
        self._first_s, self._last_s = float("inf"), float("-inf")
        self._lock = threading.Lock()

    @contextmanager
    def span(self, stage: str, what: str, kind: str = "compute", n_bytes: int = 0, batch: int = 0):
        key = object()
        if self.enabled:
            with self._lock:  # the start is taken under the lock: no span can start before a fold's horizon
                start = time.perf_counter()
                self._open[id(key)] = start - self.t0
        else:
            start = time.perf_counter()
        try:
            yield
        finally:
            if self.enabled:
                s = Span(stage=stage, what=what, start_s=start - self.t0, end_s=time.perf_counter() - self.t0,
                         kind=kind, n_bytes=n_bytes, batch=batch, thread=threading.get_ident())
                with self._lock:
                    del self._open[id(key)]
                    self._add(s)
                if self.on_span is not None:
                    self.on_span(s)

    def _add(self, s: Span) -> None:
        if self.keep_spans:
            self._spans.append(s)
        self._pending.append(s)
        if s.kind == "io":
            self._read_bytes += s.n_bytes
        self._first_s, self._last_s = min(self._first_s, s.start_s), max(self._last_s, s.end_s)
        if len(self._pending) >= FOLD_SPANS:
            horizon = min(self._open.values(), default=s.end_s)
            self._folded = self._folded + _measure(self._pending, horizon)
            self._pending = [attrs.evolve(p, start_s=max(p.start_s, horizon)) for p in self._pending
                             if p.end_s > horizon]

    @property
    def spans(self) -> list[Span]:
        """Every span of the run (keep_spans), else those not yet folded into the totals."""
        with self._lock:
            return list(self._spans if self.keep_spans else self._pending)

    def write_chrome(self, path) -> None:
        """The spans as a Trace Event file: one named track per stage (more when its spans
        overlap without nesting, as a stage's pass around other stages' work on one event loop
        does), so every track holds events that nest or follow each other, as Perfetto requires."""
        if not self.keep_spans:
            raise ValueError("write_chrome: this tracer folds its spans; make it with keep_spans=True")
        events, names = [], {}
        for tid, (track, span, start_ns, end_ns) in enumerate_tracks(self.spans):
            names.setdefault(tid, track)
            events.append({
                "name": f"{span.stage}:{span.what}", "cat": span.kind, "ph": "X", "pid": 1, "tid": tid,
                "ts": start_ns / 1e3, "dur": (end_ns - start_ns) / 1e3,
                "args": {"bytes": span.n_bytes, "batch": span.batch, "thread": span.thread},
            })
        meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
                for tid, name in names.items()]
        meta.append({"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "lever"}})
        with atomic_write(path, "w", "--trace") as f:  # never half a trace; `lever run` checked the folder first
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)

    def summary(self) -> TraceSummary:
        with self._lock:
            t = self._folded + _measure(self._pending, float("inf"))
            wall = self._last_s - self._first_s if self._pending or self._folded.stage_s else 0.0
            return TraceSummary(stage_s=t.stage_s, io_s=t.io_s, compute_s=t.compute_s, overlap_s=t.overlap_s,
                                read_bytes=self._read_bytes, wall_s=max(wall, 0.0), pass_stage_s=t.pass_s,
                                hidden_s=t.hidden_s)


@attrs.frozen
class _Totals:
    """Seconds measured on spans up to some time: unions per stage, and their overlaps."""

    stage_s: dict[str, float] = attrs.field(factory=dict)
    pass_s: dict[str, float] = attrs.field(factory=dict)
    hidden_s: dict[tuple[str, str], float] = attrs.field(factory=dict)
    io_s: float = 0.0
    compute_s: float = 0.0
    overlap_s: float = 0.0

    def __add__(self, o: _Totals) -> _Totals:
        def add(a: dict, b: dict) -> dict:
            return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}

        return _Totals(add(self.stage_s, o.stage_s), add(self.pass_s, o.pass_s), add(self.hidden_s, o.hidden_s),
                       self.io_s + o.io_s, self.compute_s + o.compute_s, self.overlap_s + o.overlap_s)


def _measure(spans: list[Span], upto: float) -> _Totals:
    """The totals of `spans` restricted to times before `upto`."""
    by_stage: dict[str, list] = defaultdict(list)
    passes: dict[str, list] = defaultdict(list)
    for s in spans:  # a "pass" span is a stage's whole unit of work, waits included: not busy time
        (passes if s.kind == "pass" else by_stage)[s.stage].append((s.start_s, s.end_s))
    busy = {k: _clip(_union(v), upto) for k, v in by_stage.items()}
    whole = {k: _clip(_union(v), upto) for k, v in passes.items()}
    io = _clip(_union([(s.start_s, s.end_s) for s in spans if s.kind == "io"]), upto)
    comp = _clip(_union([(s.start_s, s.end_s) for s in spans if s.kind == "compute"]), upto)
    return _Totals(
        {k: _length(v) for k, v in busy.items()}, {k: _length(v) for k, v in whole.items()},
        {(a, b): _length(_intersect(x, y)) for a, x in busy.items() for b, y in whole.items()},
        _length(io), _length(comp), _length(_intersect(io, comp)))


@attrs.frozen
class TraceSummary:
    stage_s: dict[str, float]  # busy seconds per stage (union of its spans)
    io_s: float  # wall seconds with at least one read in flight
    compute_s: float  # wall seconds with compute running
    overlap_s: float  # wall seconds with both
    read_bytes: int
    wall_s: float
    pass_stage_s: dict[str, float] = attrs.field(factory=dict)  # stage -> seconds inside its "pass" spans
    # (stage, under) -> the stage's busy seconds inside under's passes
    hidden_s: dict[tuple[str, str], float] = attrs.field(factory=dict, repr=False)

    def pass_s(self, stage: str) -> float:
        return self.pass_stage_s.get(stage, 0.0)

    def hidden_share(self, stage: str, under: str) -> float:
        """Share of `stage`'s busy time that fell inside `under`'s passes: for the draft under
        verify, drafting done while the target verified, off the cycle's critical path."""
        busy = self.stage_s.get(stage, 0.0)
        return self.hidden_s.get((stage, under), 0.0) / busy if busy else 0.0

    @property
    def flash_gbps(self) -> float:
        return self.read_bytes / self.io_s / 1e9 if self.io_s else 0.0

    @property
    def overlap_share(self) -> float:
        """Share of I/O time hidden under compute."""
        return self.overlap_s / self.io_s if self.io_s else 0.0


def _clip(intervals: list[tuple[float, float]], upto: float) -> list[tuple[float, float]]:
    return [(a, min(b, upto)) for a, b in intervals if a < upto]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def enumerate_tracks(spans: list[Span]):
    """(track id, (track name, span, start ns, end ns)) for every span, the spans of a stage on
    as few tracks as keep each track's events nested or apart. Times are whole nanoseconds, so
    an event that ends where its parent ends is not pushed past it by rounding."""
    lanes: dict[str, list[list[int]]] = defaultdict(list)  # stage -> per lane, the ends of its open events
    ids: dict[tuple[str, int], int] = {}
    for s in sorted(spans, key=lambda s: (s.start_s, -s.end_s)):
        start, end = round(s.start_s * 1e9), max(round(s.end_s * 1e9), round(s.start_s * 1e9))
        for lane, stack in enumerate(lanes[s.stage]):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                break
        else:
            lane = len(lanes[s.stage])
            lanes[s.stage].append([end])
        tid = ids.setdefault((s.stage, lane), len(ids))
        yield tid, (s.stage if lane == 0 else f"{s.stage} ({lane + 1})", s, start, end)
