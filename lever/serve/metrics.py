"""The server's running totals, as Prometheus reads them at /metrics (`lever serve --metrics`).

Beside lever.serve.render: the server adds each finished generation's figures (its RunResult)
and each answer's status here; `text` writes them in Prometheus's text format. The names are
llama-server's (`llamacpp:prompt_tokens_total` is `lever:prompt_tokens_total` here), so its
dashboards read Lever's with the prefix changed, plus Lever's own: drafts, acceptance, flash.
"""

from __future__ import annotations

import threading
from collections import Counter

import attrs

from lever.pipelines.result import RunResult

PREFIX = "lever:"
# name -> (type, help); one table, so every counter is written with its help and type
SERIES = {
    "prompt_tokens_total": ("counter", "Prompt tokens prefilled (those taken from a session's caches not counted)."),
    "prompt_seconds_total": ("counter", "Seconds spent prefilling, to each generation's first token."),
    "tokens_predicted_total": ("counter", "Tokens generated."),
    "tokens_predicted_seconds_total": ("counter", "Seconds spent generating after each first token."),
    "n_decode_total": ("counter", "Verification passes of the target (one streamed read of its layers each)."),
    "draft_tokens_total": ("counter", "Draft tokens grown into trees."),
    "draft_tokens_accepted_total": ("counter", "Draft tokens the target accepted."),
    "flash_read_bytes_total": ("counter", "Bytes of the target read from storage while generating."),
    "requests_total": ("counter", "Answers to generation requests, by HTTP status."),
    "requests_processing": ("gauge", "Generations running (0 or 1: one at a time)."),
    "requests_deferred": ("gauge", "Generation requests waiting in the queue."),
    "draft_acceptance_ratio": ("gauge", "Draft tokens accepted over draft tokens grown, since the start."),
    "tokens_per_pass": ("gauge", "Tokens generated per verification pass after the first, since the start."),
}


@attrs.define
class Metrics:
    totals: Counter = attrs.field(factory=Counter)
    statuses: Counter = attrs.field(factory=Counter)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def add_run(self, res: RunResult) -> None:
        """A finished generation's figures (cut ones too: their work was done)."""
        t, out = res.timing, res.output
        with self._lock:
            self.totals.update({
                "prompt_tokens_total": len(res.prompt_tokens), "prompt_seconds_total": t.prefill_s,
                "tokens_predicted_total": len(out.tokens), "tokens_predicted_seconds_total": t.decode_s,
                "n_decode_total": t.n_passes, "draft_tokens_total": res.trees.drafted_nodes,
                "draft_tokens_accepted_total": out.drafted_kept, "flash_read_bytes_total": res.flash.read_bytes,
                "_decode_passes": max(t.n_passes - 1, 0), "_decode_tokens": max(len(out.tokens) - 1, 0)})

    def add_status(self, status: int) -> None:
        with self._lock:
            self.statuses[status] += 1

    def text(self, *, processing: int, deferred: int) -> str:
        """Prometheus's text exposition format (version 0.0.4)."""
        with self._lock:
            values = {k: self.totals[k] for k in SERIES if k.endswith("_total") and k != "requests_total"}
            drafted, passes = self.totals["draft_tokens_total"], self.totals["_decode_passes"]
            values.update(requests_processing=processing, requests_deferred=deferred,
                          draft_acceptance_ratio=self.totals["draft_tokens_accepted_total"] / drafted if drafted else 0,
                          tokens_per_pass=self.totals["_decode_tokens"] / passes if passes else 0)
            statuses = dict(sorted(self.statuses.items()))
        lines = []
        for name, (kind, help_text) in SERIES.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
            if name == "requests_total":
                lines += [f'{PREFIX}{name}{{status="{s}"}} {n}' for s, n in statuses.items()]
            else:
                lines.append(f"{PREFIX}{name} {_number(values[name])}")
        return "\n".join(lines) + "\n"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))
