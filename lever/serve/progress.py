"""A streamed generation's telemetry as llama-server streams it: `return_progress` (the prompt's
prefill: how many of its tokens were cached, how many processed, of how many) and
`timings_per_token` (the timings so far on every event).

Beside the server's stream loop (lever.serve.server): a `Progress` stands where the run's watch
stands (lever.pipelines.watch: the engine tells it the run's start, with the prompt tokens it
prefills and those its caches held, and each cycle; a live page's watch behind it still sees
all), so it knows when the prefill began and ended. Lever prefills a prompt in one pass, so the
progress is two reports, both sent once the first token is out: the start (processed = cached)
and the end (processed = total). Every number is finite: a rate over no time is 0.
"""

from __future__ import annotations

import json
import threading
import time

import attrs


@attrs.define
class Progress:
    """The watch of one streamed call: `run(client)` is what the engine reports to."""

    inner: object = None  # the live page's Watch, if any
    n_prompt: int = 0  # prompt tokens prefilled
    n_cached: int = 0  # prompt tokens its caches held
    t_begin: float | None = None
    t_first: float | None = None  # the prefill's end: the first cycle
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def run(self, client: object = None) -> _Run:
        return _Run(self, self.inner.run(client) if self.inner is not None else None)

    def prompt(self) -> list[dict]:
        """llama-server's two prompt_progress reports, each with its timings: the prefill's
        start and its end."""
        with self._lock:
            total, cached = self.n_cached + self.n_prompt, self.n_cached
            ms = 1e3 * (self.t_first - self.t_begin) if self.t_first and self.t_begin else 0.0
        return [{"prompt_progress": {"total": total, "cache": cached, "processed": cached, "time_ms": 0.0},
                 "timings": self.timings(0, prompt_ms=0.0, prompt_n=0)},
                {"prompt_progress": {"total": total, "cache": cached, "processed": total, "time_ms": ms},
                 "timings": self.timings(0)}]

    def timings(self, n_out: int, *, prompt_ms: float | None = None, prompt_n: int | None = None) -> dict:
        """llama-server's timings so far, `n_out` tokens generated."""
        now = time.perf_counter()
        with self._lock:
            n_prompt = self.n_prompt if prompt_n is None else prompt_n
            if prompt_ms is None:
                prompt_ms = 1e3 * ((self.t_first or now) - self.t_begin) if self.t_begin else 0.0
            predicted_ms = 1e3 * (now - self.t_first) if self.t_first and n_out else 0.0
            cached = self.n_cached
        return {"cache_n": cached, "prompt_n": n_prompt, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": _per(prompt_ms, n_prompt), "prompt_per_second": _per(1e3 * n_prompt, prompt_ms),
                "predicted_n": n_out, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": _per(predicted_ms, n_out - 1),
                "predicted_per_second": _per(1e3 * (n_out - 1), predicted_ms)}


def _per(num: float, den: float) -> float:
    return num / den if den > 0 and num > 0 else 0.0


@attrs.define
class _Run:
    """A run's watch (lever.pipelines.watch.RunWatch's methods): the prefill's clock kept, all passed on."""

    progress: Progress
    inner: object = None

    def begin(self, *, t0_s: float, pipeline: str, n_prompt: int, n_past: int) -> None:
        p = self.progress
        with p._lock:
            p.t_begin, p.n_prompt, p.n_cached = time.perf_counter(), n_prompt, n_past
        if self.inner is not None:
            self.inner.begin(t0_s=t0_s, pipeline=pipeline, n_prompt=n_prompt, n_past=n_past)

    def span(self, s) -> None:
        if self.inner is not None:
            self.inner.span(s)

    def tree(self, tree) -> None:
        if self.inner is not None:
            self.inner.tree(tree)

    def cycle(self, acc) -> None:
        with self.progress._lock:
            if self.progress.t_first is None:
                self.progress.t_first = time.perf_counter()
        if self.inner is not None:
            self.inner.cycle(acc)

    def end(self, **figures) -> None:
        if self.inner is not None:
            self.inner.end(**figures)


def with_fields(event: str, fields: dict) -> str:
    """An SSE event whose data is a JSON object, with `fields` added to it (the timings on a
    streamed piece); any other event as it is."""
    head, sep, data = event.rpartition("data: ")
    if not sep or not data.strip().startswith("{"):
        return event
    return f"{head}data: {json.dumps(json.loads(data) | fields, ensure_ascii=False)}\n\n"
