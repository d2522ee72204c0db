"""lever.serve.progress: a stream's prefill reports and timings so far, from what the engine tells
a run's watch (passed on to the live page's watch behind it), every number finite and never
negative; fields added to an SSE event's JSON and to nothing else."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from lever.serve.progress import Progress, with_fields
from tests.sizes import cases


class Inner:
    """A live page's watch, recording what its run's watch is told."""

    def __init__(self):
        self.told = []

    def run(self, client=None):
        inner = self

        class Run:
            def __getattr__(self, name):
                return lambda *a, **k: inner.told.append((client, name))
        return Run()


@settings(max_examples=cases(60), deadline=None, database=None)
@given(n_prompt=st.integers(1, 5000), n_cached=st.integers(0, 5000), n_out=st.integers(0, 300),
       cycles=st.integers(0, 3))
def test_the_prefills_reports_and_the_timings_so_far(n_prompt, n_cached, n_out, cycles):
    inner = Inner()
    p = Progress(inner)
    run = p.run("key")
    run.begin(t0_s=0.0, pipeline="speculative", n_prompt=n_prompt, n_past=n_cached)
    for _ in range(cycles):
        run.cycle(None)
    run.end(stop_reason="eos", n_tokens=n_out, tokens_per_pass=1.0, decode_s=0.1)
    start, end = p.prompt()
    total = n_prompt + n_cached
    assert start["prompt_progress"] | {"time_ms": 0} == {"total": total, "cache": n_cached, "processed": n_cached,
                                                         "time_ms": 0}
    assert end["prompt_progress"]["processed"] == total and end["prompt_progress"]["cache"] == n_cached
    assert start["timings"]["prompt_n"] == 0 and start["timings"]["prompt_ms"] == 0
    assert end["timings"]["prompt_n"] == n_prompt and end["timings"]["predicted_n"] == 0
    t = p.timings(n_out)
    assert t["predicted_n"] == n_out and t["cache_n"] == n_cached
    assert all(math.isfinite(v) and v >= 0 for d in (start["timings"], end["timings"], t) for v in d.values())
    assert [name for _, name in inner.told] == ["begin", *["cycle"] * cycles, "end"]  # the page sees it all
    assert {client for client, _ in inner.told} == {"key"}


def test_fields_go_into_an_events_json_only():
    assert json.loads(with_fields('data: {"a": 1}\n\n', {"timings": {"x": 2}})[6:]) == {"a": 1, "timings": {"x": 2}}
    named = with_fields('event: response.output_text.delta\ndata: {"type": "d"}\n\n', {"t": 1})
    assert named.startswith("event: response.output_text.delta\ndata: ") and named.endswith('"t": 1}\n\n')
    assert with_fields("data: [DONE]\n\n", {"t": 1}) == "data: [DONE]\n\n"
    assert with_fields('{"not": "sse"}\n', {"t": 1}) == '{"not": "sse"}\n'  # Ollama's NDJSON: left alone
