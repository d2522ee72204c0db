"""The server's running totals, as Prometheus reads them at /metrics (`lever serve --metrics`).

Beside lever.serve.render: the server adds each finished generation's figures (its RunResult and
the prompt tokens its session's caches held) and each answer's status here; `text` writes them
in Prometheus's text format. llama-server's series have its names and its prefix
(`llamacpp:prompt_tokens_total`), so its dashboards read Lever's unchanged; Lever's own
(answers by status, acceptance, tokens per pass, flash reads) are prefixed `lever:`. The answer
carries llama-server's Process-Start-Time-Unix header (lever.serve.server).
"""

from __future__ import annotations

import threading
from collections import Counter

import attrs

from lever.pipelines.result import RunResult

LLAMA = "llamacpp:"
PREFIX = "lever:"
# name -> (prefix, type, help); one table, so every series is written with its help and type.
# The gauges of throughput are averages since the start (llama-server's, between two scrapes)
SERIES = {
    "prompt_tokens_total": (LLAMA, "counter", "Prompt tokens prefilled (those taken from a session's caches not "
                                              "counted)."),
    "prompt_tokens_cached_total": (LLAMA, "counter", "Prompt tokens taken from a session's caches, not prefilled."),
    "prompt_seconds_total": (LLAMA, "counter", "Seconds spent prefilling, to each generation's first token."),
    "tokens_predicted_total": (LLAMA, "counter", "Tokens generated."),
    "tokens_predicted_seconds_total": (LLAMA, "counter", "Seconds spent generating after each first token."),
    "n_decode_total": (LLAMA, "counter", "Passes of the target (one streamed read of its layers each)."),
    "n_tokens_max": (LLAMA, "counter", "Largest sequence seen (prompt and generation)."),
    "spec_decode_num_draft_tokens_total": (LLAMA, "counter", "Draft tokens grown into trees."),
    "spec_decode_num_accepted_tokens_total": (LLAMA, "counter", "Draft tokens the target accepted."),
    "spec_decode_num_drafts_total": (LLAMA, "counter", "Verification passes of a drafted tree."),
    "prompt_tokens_seconds": (LLAMA, "gauge", "Prompt tokens prefilled per second, since the start."),
    "predicted_tokens_seconds": (LLAMA, "gauge", "Tokens generated per second after each first token, since the "
                                                 "start."),
    "requests_processing": (LLAMA, "gauge", "Generations running (at most --parallel)."),
    "requests_deferred": (LLAMA, "gauge", "Generation requests waiting in the queue."),
    "n_busy_slots_per_decode": (LLAMA, "gauge", "Generations' trees per pass of the target (shared under "
                                                "--parallel)."),
    "requests_total": (PREFIX, "counter", "Answers to generation requests, by HTTP status."),
    "flash_read_bytes_total": (PREFIX, "counter", "Bytes of the target read from storage while generating."),
    "draft_acceptance_ratio": (PREFIX, "gauge", "Draft tokens accepted over draft tokens grown, since the start."),
    "tokens_per_pass": (PREFIX, "gauge", "Tokens generated per verification pass after the first, since the start."),
    "shared_passes_total": (PREFIX, "counter", "Passes of the target that the generations running at once shared "
                                               "(--parallel)."),
    "shared_pass_trees_total": (PREFIX, "counter", "Trees (and prompts) those passes verified."),
    "shared_pass_nodes_total": (PREFIX, "counter", "Nodes (and prompt tokens) those passes verified."),
    "shared_pass_seconds_total": (PREFIX, "counter", "Seconds those passes took."),
    "shared_pass_predicted_seconds_total": (PREFIX, "counter", "Seconds the cost model priced those passes at."),
}


@attrs.define
class Metrics:
    totals: Counter = attrs.field(factory=Counter)
    statuses: Counter = attrs.field(factory=Counter)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def add_run(self, res: RunResult, cached: int = 0) -> None:
        """A finished generation's figures (cut ones too: their work was done); `cached`: its
        prompt's tokens a session's caches held."""
        t, out = res.timing, res.output
        drafted = res.trees.drafted_nodes
        with self._lock:
            self.totals.update({
                "prompt_tokens_total": len(res.prompt_tokens), "prompt_tokens_cached_total": cached,
                "prompt_seconds_total": t.prefill_s, "tokens_predicted_total": len(out.tokens),
                "tokens_predicted_seconds_total": t.decode_s, "n_decode_total": t.n_passes,
                "spec_decode_num_draft_tokens_total": drafted,
                "spec_decode_num_accepted_tokens_total": out.drafted_kept,
                "spec_decode_num_drafts_total": max(t.n_passes - 1, 0) if drafted else 0,
                "flash_read_bytes_total": res.flash.read_bytes,
                "_decode_passes": max(t.n_passes - 1, 0), "_decode_tokens": max(len(out.tokens) - 1, 0)})
            n = cached + len(res.prompt_tokens) + len(out.tokens)
            self.totals["n_tokens_max"] = max(self.totals["n_tokens_max"], n)

    def add_status(self, status: int) -> None:
        with self._lock:
            self.statuses[status] += 1

    def text(self, *, processing: int, deferred: int, batcher=None) -> str:
        """Prometheus's text exposition format (version 0.0.4). `batcher`: the passes that the
        generations running at once share (lever.pipelines.batcher), whose own counts give the
        slots per pass and the bytes read (a run's own count is the process's, everyone's)."""
        with self._lock:
            tot = self.totals
            values = {k: tot[k] for k, (_, kind, _) in SERIES.items() if kind == "counter" and k != "requests_total"}
            drafted, passes = tot["spec_decode_num_draft_tokens_total"], tot["_decode_passes"]
            values.update(requests_processing=processing, requests_deferred=deferred,
                          prompt_tokens_seconds=_per(tot["prompt_tokens_total"], tot["prompt_seconds_total"]),
                          predicted_tokens_seconds=_per(tot["_decode_tokens"], tot["tokens_predicted_seconds_total"]),
                          n_busy_slots_per_decode=(_per(batcher.trees, batcher.passes) if batcher is not None
                                                   else 1 if tot["n_decode_total"] else 0),
                          draft_acceptance_ratio=_per(tot["spec_decode_num_accepted_tokens_total"], drafted),
                          tokens_per_pass=_per(tot["_decode_tokens"], passes))
            shared = {"passes": "shared_passes_total", "trees": "shared_pass_trees_total",
                      "nodes": "shared_pass_nodes_total", "seconds": "shared_pass_seconds_total",
                      "predicted_s": "shared_pass_predicted_seconds_total"}
            values.update({name: getattr(batcher, k) if batcher is not None else 0 for k, name in shared.items()})
            if batcher is not None:
                values["flash_read_bytes_total"] = batcher.read_bytes
            statuses = dict(sorted(self.statuses.items()))
        lines = []
        for name, (prefix, kind, help_text) in SERIES.items():
            lines += [f"# HELP {prefix}{name} {help_text}", f"# TYPE {prefix}{name} {kind}"]
            if name == "requests_total":
                lines += [f'{prefix}{name}{{status="{s}"}} {n}' for s, n in statuses.items()]
            else:
                lines.append(f"{prefix}{name} {_number(values[name])}")
        return "\n".join(lines) + "\n"


def _per(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))
