"""A run's result: its tokens, the stages' own figures, and what the run measured around them.

The stages report their figures as they count them (OutputStats, TreeStats, VerifyStats,
DraftStats); a RunResult keeps them so, beside what only the run can measure: its clocks and
the tracer's spans (`Timing`), the device's byte counter (`FlashFigures`), peak RSS against the
memory plan (`MemoryFigures`). `as_json` is `lever run --json`'s object, which the benches read.
"""

from __future__ import annotations

import attrs

from lever.gguf.vocab_map import VocabFigures
from lever.model.grammar import ConstraintStats
from lever.model.stop import StopReason
from lever.policy.memory import MemoryPlan
from lever.stages.draft import DraftStats
from lever.stages.output import OutputStats
from lever.stages.pruned_verify import VerifyStats
from lever.tree.cycle import TreeStats


@attrs.frozen
class Timing:
    """Where a run's time went (wall seconds; spans from the tracer)."""

    prefill_s: float
    decode_s: float
    n_passes: int  # verification passes, the prefill's first
    stage_s: dict[str, float]  # each stage's busy time
    io_s: float  # time with a flash read under way
    compute_s: float  # time with compute under way
    overlap_share: float  # share of read time hidden under compute
    verify_pass_s: float = 0.0  # time with a verification pass under way (reads and waits included)
    draft_s: float = 0.0  # time the draft model computed
    accept_s: float = 0.0  # Accept: the output head along the accepted path
    draft_hidden_share: float = 0.0  # share of drafting done while a verification pass was under way
    decode_cpu_s: float = 0.0  # CPU seconds the process spent decoding, every thread (an energy proxy)
    # (seconds since the run began, tokens emitted then) at each pass that emitted: tok/s over time
    emits_s: tuple[tuple[float, int], ...] = ()
    started_s: float = 0.0  # time.monotonic() as the run began, so other clocks' events line up with emits_s

    @property
    def flash_busy_share(self) -> float:
        """Share of the run's wall time with a flash read under way (1.0: reads never paused)."""
        wall = self.prefill_s + self.decode_s
        return min(self.io_s / wall, 1.0) if wall > 0 else 0.0

    @property
    def pass_wall_ratio(self) -> float:
        """Wall time per pass over the larger of a pass's read and compute time: 1.0 is perfect overlap."""
        per_pass = max(self.io_s, self.compute_s) / self.n_passes if self.n_passes else 0.0
        return (self.prefill_s + self.decode_s) / self.n_passes / per_pass if per_pass else 0.0


@attrs.frozen
class FlashFigures:
    """What the target's storage did."""

    streamed_bytes_per_pass: int  # layer bytes one pass reads
    read_bytes: int  # read from the device during decoding (the process's counter, not what was asked)
    requested_bytes: int  # what the store asked for
    gbps: float  # while reading


@attrs.frozen
class MemoryFigures:
    """DRAM: the target's parts, what was planned before loading, what was used (the caches and
    the draft: the stages' own figures, RunResult.verify and .draft)."""

    resident_layer_bytes: int
    head_bytes: int  # the output projection, resident
    window_bytes: int  # staging buffers for streamed layers
    peak_rss_bytes: int
    plan: MemoryPlan | None = None  # lever.policy.memory's plan, checked against [memory] limit
    fill: MemoryPlan | None = None  # [flash] dram_budget = "fill" (--mem): the plan that placed the resident layers

    @property
    def rss_bound_bytes(self) -> int:
        return self.plan.rss_bound_bytes if self.plan is not None else 0


@attrs.frozen
class RunResult:
    """One generation: its text, the figures its stages reported, and the run's own measures."""

    pipeline: str
    prompt_tokens: list[int]
    text: str
    output: OutputStats  # the tokens, per pass, and why the run stopped
    trees: TreeStats
    verify: VerifyStats
    draft: DraftStats | None  # None: no draft model ran
    timing: Timing
    flash: FlashFigures
    memory: MemoryFigures
    placement: dict[str, str] = attrs.field(factory=dict)  # where each stage's work ran
    channels: dict[str, dict] = attrs.field(factory=dict)  # each channel's ChannelStats (messages, backlog)
    temperature: float = 0.0  # 0: greedy, so the tokens must equal the target's own greedy decoding
    baseline: RunResult | None = None  # [pipeline] baseline run on the same prompt, when configured
    vocab: VocabFigures | None = None  # the draft's token table mapped to the target's; None: the same one, or no draft
    grammar: ConstraintStats | None = None  # the masks a grammar computed; None: free text
    # a live memory budget's moves (lever.pipelines.memory_watch): (seconds since the run began,
    # "limit" or "squeeze", the budget in bytes then)
    memory_events: tuple[tuple[float, str, int], ...] = ()

    @property
    def tokens(self) -> list[int]:
        return list(self.output.tokens)

    @property
    def stop_reason(self) -> StopReason | None:
        return self.output.stop_reason

    @property
    def speedup(self) -> float:
        """Decode speed over the baseline's, measured in the same run (0 without one)."""
        return self.baseline.ms_per_token / self.ms_per_token if self.baseline and self.ms_per_token else 0.0

    @property
    def baseline_tokens_equal(self) -> bool | None:
        return None if self.baseline is None else self.tokens == self.baseline.tokens

    @property
    def decode_tps(self) -> float:
        return len(self.output.tokens[1:]) / self.timing.decode_s if self.timing.decode_s > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 / self.decode_tps if self.decode_tps else 0.0

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens per second of prefill: the whole prompt is one tree, one streamed pass
        (the memory plan sizes the activations for it before loading)."""
        return len(self.prompt_tokens) / self.timing.prefill_s if self.timing.prefill_s > 0 else 0.0

    @property
    def cpu_ms_per_token(self) -> float:
        """CPU time per generated token, all threads: what the paper's energy row stands for."""
        return 1e3 * self.timing.decode_cpu_s / max(len(self.output.tokens) - 1, 1)

    @property
    def flash_mb_per_token(self) -> float:
        return self.flash.read_bytes / max(len(self.output.tokens) - 1, 1) / 1e6

    @property
    def draft_bytes(self) -> int:
        """The draft model's weights and KV cache, all resident."""
        return self.draft.weights_bytes + self.draft.kv_cache_bytes if self.draft is not None else 0

    @property
    def budget_bytes(self) -> int:
        """DRAM the configuration accounts for: resident layers, head, window, KV cache, draft."""
        m = self.memory
        return m.resident_layer_bytes + m.head_bytes + m.window_bytes + self.verify.kv_cache_bytes + self.draft_bytes

    def as_json(self) -> dict:
        """`lever run --json`: every figure, in sections (timing, flash, memory, tree)."""
        t, m, tr, v = self.timing, self.memory, self.trees, self.verify
        d = {"pipeline": self.pipeline, "prompt_tokens": self.prompt_tokens, "tokens": self.tokens, "text": self.text,
             "stop_reason": self.stop_reason,
             "timing": attrs.asdict(t) | {"pass_wall_ratio": t.pass_wall_ratio, "flash_busy_share": t.flash_busy_share},
             "flash": attrs.asdict(self.flash),
             "memory": attrs.asdict(m) | {"budget_bytes": self.budget_bytes, "kv_cache_bytes": v.kv_cache_bytes,
                                          "draft_bytes": self.draft_bytes, "rss_bound_bytes": m.rss_bound_bytes},
             "tree": {"accepted_per_pass": self.output.tokens_per_pass, "mean_nodes": tr.mean_nodes,
                      "lookahead_hit_share": tr.lookahead_hit_share,
                      "ahead_nodes": tr.ahead_nodes, "ahead_used_share": tr.ahead_used_share,
                      "token_layers": v.token_layers,
                      "layer_tokens": list(v.layer_tokens), "prune_layer": v.prune_layer,
                      "pruned_share": v.pruned_share,
                      "draft_forward_tokens": self.draft.forward_tokens if self.draft is not None else {},
                      "cycles": [attrs.asdict(c) for c in tr.cycles], "predicted_cycle_s": tr.predicted_cycle_s,
                      "measured_cycle_s": tr.measured_cycle_s, "predicted_tokens": tr.predicted_tokens,
                      "measured_tokens": tr.measured_tokens, "shapes": tr.shapes,
                      "fallback_switches": tr.fallback_switches},
             "placement": self.placement, "channels": self.channels, "temperature": self.temperature,
             "vocab": attrs.asdict(self.vocab) if self.vocab is not None else None,
             "grammar": attrs.asdict(self.grammar) if self.grammar is not None else None,
             "memory_events": [list(e) for e in self.memory_events],
             "decode_tps": self.decode_tps, "ms_per_token": self.ms_per_token, "prefill_tps": self.prefill_tps,
             "flash_mb_per_token": self.flash_mb_per_token, "cpu_ms_per_token": self.cpu_ms_per_token}
        if self.baseline is not None:
            d.update(baseline=self.baseline.as_json(), speedup=self.speedup,
                     baseline_tokens_equal=self.baseline_tokens_equal)
        return d
