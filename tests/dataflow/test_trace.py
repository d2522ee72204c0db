"""lever.dataflow.trace: the totals folded in as a run goes equal those of every span kept, and a long
run holds a bounded number of spans."""

from __future__ import annotations

import numpy as np
import pytest

from lever.dataflow import trace
from lever.dataflow.trace import Span, Tracer, _measure

STAGES = ("prefetch", "verify", "draft", "accept")
KINDS = ("io", "compute", "pass", "other")


def timeline(n: int, seed: int) -> list[Span]:
    """Overlapping spans of several stages, in the order they would end (and be recorded)."""
    rng = np.random.default_rng(seed)
    spans = []
    for i in range(n):
        start = float(rng.uniform(0, n / 4))
        spans.append(Span(STAGES[i % 4], f"w{i}", start, start + float(rng.exponential(1.0)), KINDS[rng.integers(4)],
                          int(rng.integers(0, 1000))))
    return sorted(spans, key=lambda s: s.end_s)


def replay(tracer: Tracer, spans: list[Span]) -> None:
    """Record each span when it ends, with the spans under way at that moment open."""
    by_start = sorted(range(len(spans)), key=lambda i: spans[i].start_s)
    for s in spans:
        tracer._open = {i: spans[i].start_s for i in by_start
                        if spans[i].start_s <= s.end_s < spans[i].end_s}
        tracer._add(s)
    tracer._open = {}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_folded_totals_equal_the_whole(monkeypatch, seed):
    monkeypatch.setattr(trace, "FOLD_SPANS", 16)
    spans = timeline(600, seed)
    t = Tracer()
    replay(t, spans)
    got, want = t.summary(), _measure(spans, float("inf"))
    assert got.io_s == pytest.approx(want.io_s, abs=1e-9)
    assert got.compute_s == pytest.approx(want.compute_s, abs=1e-9)
    assert got.overlap_s == pytest.approx(want.overlap_s, abs=1e-9)
    assert got.stage_s == pytest.approx(want.stage_s, abs=1e-9)
    assert got.pass_stage_s == pytest.approx(want.pass_s, abs=1e-9)
    assert got.hidden_s == pytest.approx(want.hidden_s, abs=1e-9)
    assert got.read_bytes == sum(s.n_bytes for s in spans if s.kind == "io")
    assert got.wall_s == pytest.approx(max(s.end_s for s in spans) - min(s.start_s for s in spans))


def test_a_long_run_holds_a_bounded_number_of_spans(monkeypatch):
    monkeypatch.setattr(trace, "FOLD_SPANS", 64)
    t = Tracer()
    for i in range(5000):
        with t.span("verify", f"layer {i}"):
            pass
    assert len(t.spans) <= 64 and t.summary().stage_s["verify"] > 0


def test_trace_file_needs_every_span(tmp_path):
    with pytest.raises(ValueError, match="keep_spans"):
        Tracer().write_chrome(tmp_path / "t.json")


def test_tracks_keep_a_stages_spans_nested_or_apart():
    # A pass around work, a span crossing its end, one after both: the crossing one moves to a
    # second track of the same stage; the rest share the first.
    spans = [Span("verify", "pass", 0.0, 1.0, "pass"), Span("verify", "layer", 0.1, 0.2, "compute"),
             Span("verify", "cross", 0.9, 1.5, "compute"), Span("verify", "after", 1.6, 1.7, "compute"),
             Span("draft", "expand", 0.5, 2.0, "compute")]
    tracks = {span.what: (tid, name) for tid, (name, span, _, _) in trace.enumerate_tracks(spans)}
    assert tracks["pass"] == tracks["layer"] == tracks["after"] != tracks["cross"]
    assert tracks["cross"][1] == "verify (2)" and tracks["expand"][1] == "draft"
