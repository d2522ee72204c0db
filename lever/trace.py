"""Spans recorded by every stage, a Chrome/Perfetto trace, and the overlap figure.

Stages wrap each piece of work in `tracer.span(stage, what, bytes=..., batch=...)`. The run
summary reads the spans back: seconds per stage, the flash bandwidth achieved, and how much of
the time spent reading was hidden under compute (the overlap that channel scheduling is for).
`--trace out.json` writes them in the Trace Event format that chrome://tracing and Perfetto open.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import attrs


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


class Tracer:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, stage: str, what: str, kind: str = "compute", n_bytes: int = 0, batch: int = 0):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.enabled:
                s = Span(stage, what, start - self.t0, time.perf_counter() - self.t0, kind, n_bytes, batch,
                         threading.get_ident())
                with self._lock:
                    self._spans.append(s)

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def write_chrome(self, path) -> None:
        tids: dict[int, int] = {}
        events = []
        for s in self.spans:
            tid = tids.setdefault(s.thread, len(tids))
            events.append({
                "name": f"{s.stage}:{s.what}", "cat": s.kind, "ph": "X", "pid": 1, "tid": tid,
                "ts": s.start_s * 1e6, "dur": (s.end_s - s.start_s) * 1e6,
                "args": {"bytes": s.n_bytes, "batch": s.batch},
            })
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def summary(self) -> TraceSummary:
        return summarize(self.spans)


@attrs.frozen
class TraceSummary:
    stage_s: dict[str, float]  # busy seconds per stage (union of its spans)
    io_s: float  # wall seconds with at least one read in flight
    compute_s: float  # wall seconds with compute running
    overlap_s: float  # wall seconds with both
    read_bytes: int
    wall_s: float
    stage_intervals: dict[str, list] = attrs.field(factory=dict, repr=False)  # stage -> union of its busy spans
    pass_intervals: dict[str, list] = attrs.field(factory=dict, repr=False)  # stage -> union of its "pass" spans

    def pass_s(self, stage: str) -> float:
        return _length(self.pass_intervals.get(stage, []))

    def hidden_share(self, stage: str, under: str) -> float:
        """Share of `stage`'s busy time that fell inside `under`'s passes: for the draft under
        verify, drafting done while the target verified, off the cycle's critical path."""
        own = self.stage_intervals.get(stage, [])
        busy = _length(own)
        return _length(_intersect(own, self.pass_intervals.get(under, []))) / busy if busy else 0.0

    @property
    def flash_gbps(self) -> float:
        return self.read_bytes / self.io_s / 1e9 if self.io_s else 0.0

    @property
    def overlap_share(self) -> float:
        """Share of I/O time hidden under compute."""
        return self.overlap_s / self.io_s if self.io_s else 0.0


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


def summarize(spans: list[Span]) -> TraceSummary:
    by_stage: dict[str, list] = defaultdict(list)
    passes: dict[str, list] = defaultdict(list)
    for s in spans:  # a "pass" span is a stage's whole unit of work, waits included: not busy time
        (passes if s.kind == "pass" else by_stage)[s.stage].append((s.start_s, s.end_s))
    io = _union([(s.start_s, s.end_s) for s in spans if s.kind == "io"])
    comp = _union([(s.start_s, s.end_s) for s in spans if s.kind == "compute"])
    wall = (max(s.end_s for s in spans) - min(s.start_s for s in spans)) if spans else 0.0
    busy = {k: _union(v) for k, v in by_stage.items()}
    return TraceSummary(
        stage_s={k: _length(v) for k, v in busy.items()},
        io_s=_length(io), compute_s=_length(comp), overlap_s=_length(_intersect(io, comp)),
        read_bytes=sum(s.n_bytes for s in spans if s.kind == "io"), wall_s=wall,
        stage_intervals=busy, pass_intervals={k: _union(v) for k, v in passes.items()},
    )
