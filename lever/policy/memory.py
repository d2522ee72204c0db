"""Memory: what a run needs in DRAM, computed from the files' headers before anything is loaded.

`lever run` (and every bench run through it) asks `plan_memory` first, with the target's and
draft's GGUF headers parsed and the prompt tokenized but no layer read and no cache allocated.
The plan sums the target's resident layers, its output head, the staging window, both KV
caches for the context, the draft's weights, activations for the largest pass, and the
process as it stands (interpreter, libraries, tokenizer); `check` then refuses, with those
figures, a plan over `[memory] limit` or over what the machine has available. During the run
the summary sets peak RSS beside the plan; tests hold it within `plan + margin`.
"""

from __future__ import annotations

import attrs
import psutil

from lever.backends.cpu.kv_cache import KVCache
from lever.backends.cpu.layer import PASS_CHUNK_TOKENS, resident_layer_bytes, tiled_bytes
from lever.backends.flash import FlashConfig
from lever.backends.flash.config import parse_bytes, plan_residency, spread
from lever.backends.flash.layout import layer_extents
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import ModelSpec
from lever.model.transformer import Model

F32 = 4
# Allocator slack, thread stacks, numpy temporaries the activation estimate does not name:
# measured peak RSS minus the named parts stayed well under this on every configuration tried
# (docs/measurements.md, 'Memory plan: slack and the QNN runtime'); tests/policy/test_memory.py
# holds runs to the bound.
RUNTIME_SLACK_BYTES = 64 * 2**20
MARGIN_SHARE = 0.10  # peak RSS may exceed the plan by this share (plus RUNTIME_SLACK_BYTES)
# onnxruntime-qnn's own allocations, which no GGUF header names: the runtime and HTP backend
# libraries (in the x86-64 wheel, Qualcomm's simulator), their arenas and the compiled graph
# sessions. The bound is the peak RSS of a run of examples/snapdragon-8gen3.toml with verify and
# draft_batch on qnn less that of the same run with both on "cpu", rounded up
# (docs/measurements.md, 'Memory plan: slack and the QNN runtime').
# Measured on the tiny pair only: a larger model's graphs and fp16 weight inputs add to it (a
# run over the bound says so, see over_bound_warning), and on a phone the HTP libraries replace
# the simulator.
QNN_RUNTIME_BYTES = 224 * 2**20


@attrs.frozen
class MemoryConfig:
    """[memory]: the DRAM a run may use, checked before anything is loaded."""

    limit: int | str = "auto"
    """The whole run's DRAM: bytes (int, or "6GiB", "800MB"), or "auto": what the machine has
    available now (what [flash] dram_budget = "fill" fills: AUTO_FILL_SHARE of it). A
    configuration whose plan exceeds it is refused with the figures."""

    follow: bool = True
    """Follow the memory the system grants while the run goes: under a memory cgroup (a phone's
    OS, `memcap`), with [flash] dram_budget = "fill", the resident layers shrink at once when its
    limit falls or it is under pressure, and are read back when it rises, never past `limit`
    (lever.pipelines.memory_watch)."""

    def __attrs_post_init__(self):
        self.limit_bytes  # noqa: B018  (parses it, so a bad value fails when the config loads)

    @property
    def limit_bytes(self) -> int | None:
        if self.limit == "auto":
            return None
        n = parse_bytes(self.limit)
        if n is None or n <= 0:
            raise LeverError(f"[memory] limit: must be \"auto\" or a positive size in bytes (e.g. 6GiB), "
                             f"got {self.limit!r}")
        return n


@attrs.frozen
class MemoryPlan:
    """Bytes a run needs, by part; `total_bytes` is what `check` holds against the limit."""

    resident_layer_bytes: int  # target layers read once and kept (matrices in the tile layout)
    head_bytes: int  # the target's output projection (and embeddings when tied), resident, tiled
    window_bytes: int  # the staging window streamed layers pass through (+ mmap chunks in flight)
    kv_cache_bytes: int  # the target's KV cache for the context and one tree (one per generation at once)
    draft_bytes: int  # the draft's weights (Model.resident_bytes) and its KV cache
    activation_bytes: int  # the largest pass's activations and logits, both models
    process_bytes: int  # the process before loading: interpreter, libraries, tokenizer
    slack_bytes: int = RUNTIME_SLACK_BYTES
    runtime_bytes: int = 0  # an accelerator runtime's own allocations (QNN_RUNTIME_BYTES when a stage is on qnn)
    grammar_bytes: int = 0  # structured output: compiled grammars, a generation's matcher, the compiler's child

    @property
    def total_bytes(self) -> int:
        return sum(attrs.astuple(self))

    def describe(self) -> str:
        parts = (("resident layers", self.resident_layer_bytes), ("head", self.head_bytes),
                 ("window", self.window_bytes), ("KV cache", self.kv_cache_bytes), ("draft", self.draft_bytes),
                 ("activations", self.activation_bytes), ("process", self.process_bytes),
                 ("slack", self.slack_bytes)) + ((("QNN runtime", self.runtime_bytes),) if self.runtime_bytes else ()) \
            + ((("grammars", self.grammar_bytes),) if self.grammar_bytes else ())
        return f"{mib(self.total_bytes)} = " + " + ".join(f"{name} {mib(n)}" for name, n in parts)

    @property
    def rss_bound_bytes(self) -> int:
        """What peak RSS should stay under: the plan plus the stated margin."""
        return int(self.total_bytes * (1 + MARGIN_SHARE)) + RUNTIME_SLACK_BYTES

    def over_bound_warning(self, peak_rss_bytes: int) -> str | None:
        """One line for stderr when a run's peak RSS passed `rss_bound_bytes` (the plan missed
        an allocation: a runtime's own arenas, say), else None."""
        bound = self.rss_bound_bytes
        if peak_rss_bytes <= bound:
            return None
        counted = f" (the QNN runtime counted as {mib(self.runtime_bytes)})" if self.runtime_bytes else ""
        return (f"peak RSS {mib(peak_rss_bytes)} passed the memory plan's bound with margin ({mib(bound)}) by "
                f"{mib(peak_rss_bytes - bound)}{counted}: the plan does not count everything this run allocated")


def runtime_bytes_for(placement) -> int:
    """What `placement` (a PlacementConfig) adds beyond the files' figures: QNN_RUNTIME_BYTES
    when any stage asks for qnn. Counted even where it will fall back to the CPU: the plan is
    made before the backend is tried, and over-counting only makes the check stricter."""
    return QNN_RUNTIME_BYTES if any(getattr(placement, k, "cpu") == "qnn" for k in ("verify", "draft_batch")) else 0


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def activation_bytes(spec: ModelSpec, n_tok: int, n_rows: int, n_logit_rows: int) -> int:
    """A pass of n_tok tokens: one chunk's live arrays in a layer (residual, norm, q/k/v,
    attention, the FFN's gate/up/product, its mask; a layer runs PASS_CHUNK_TOKENS at a time),
    the whole pass's hidden states in and out and its attention mask over n_rows, and
    n_logit_rows rows of vocabulary logits."""
    per_tok = 4 * spec.n_embd + 2 * (spec.n_head + 2 * spec.n_head_kv) * spec.head_dim + 3 * spec.n_ff
    chunk = min(n_tok, PASS_CHUNK_TOKENS)
    return chunk * (per_tok * F32 + n_rows) + n_tok * (2 * spec.n_embd * F32 + n_rows) + \
        n_logit_rows * spec.n_vocab * F32


def plan_memory(target: GGUFFile, spec: ModelSpec, flash: FlashConfig, *, n_ctx: int, n_pass_tokens: int,
                parallel: int = 1, tree_rows: int = 1, head_rows: int | None = None, draft: GGUFFile | None = None,
                draft_spec: ModelSpec | None = None,
                draft_rows: int = 0, process_bytes: int | None = None, runtime_bytes: int = 0,
                resident: frozenset[int] | None = None, grammar_bytes: int = 0) -> MemoryPlan:
    """The plan of one run: n_ctx context rows, passes of at most n_pass_tokens tokens (the
    prompt's prefill or a tree of tree_rows, the output head over head_rows of them: the
    accepted path's; None: all), a draft's cache of n_ctx + draft_rows rows, and
    `runtime_bytes` of an accelerator runtime (`runtime_bytes_for(cfg.placement)`), and
    `grammar_bytes` of structured output (lever.model.grammar_cache.plan_bytes); `resident`:
    the layers kept in DRAM (a RunPlan's), else planned from `flash`. `parallel` generations at
    once ([pipeline] parallel): each its own caches and drafting, and the target's pass of all
    their prompts or trees together (one read of the weights, so one window)."""
    extents = layer_extents(target)
    layer_bytes = [e.buffer_bytes for e in extents]
    if resident is None:
        resident = plan_residency(layer_bytes, flash.dram_budget)
    streamed = [b for i, b in enumerate(layer_bytes) if i not in resident]
    window = flash.window_layers * max(streamed, default=0)
    if flash.mode == "mmap" and streamed:
        window += flash.queue_depth * flash.chunk_bytes  # mapped pages of the chunks being copied
    head = tiled_bytes(target, "output.weight" if "output.weight" in target.tensors else "token_embd.weight")
    n_rows = n_ctx + tree_rows
    logit_rows = max(tree_rows if head_rows is None else head_rows, 1)
    acts = activation_bytes(spec, parallel * n_pass_tokens, n_rows, parallel * logit_rows)
    draft_total = 0
    if draft is not None and draft_spec is not None:
        draft_kv = KVCache.bytes_for(draft_spec, n_ctx + draft_rows)
        draft_total = Model.resident_bytes(draft, draft_spec) + parallel * draft_kv
        acts += parallel * activation_bytes(draft_spec, max(n_pass_tokens, draft_rows), n_ctx + draft_rows,
                                            draft_rows)
    if process_bytes is None:
        process_bytes = psutil.Process().memory_info().rss
    return MemoryPlan(sum(resident_layer_bytes(target, spec, i) for i in resident), head, window,
                      parallel * KVCache.bytes_for(spec, n_rows), draft_total, acts, process_bytes,
                      runtime_bytes=runtime_bytes, grammar_bytes=grammar_bytes)


def mem_overrides(size: int | str) -> list[str]:
    """`--mem SIZE` (and lever.load's `mem=`) as the config values it stands for: the limit, and
    resident layers filling it. Given before a caller's own overrides, so theirs win."""
    value = size if isinstance(size, int) else '"' + str(size).replace('"', "") + '"'
    return [f"memory.limit={value}", 'flash.dram_budget="fill"']


def fill_residency(limit_bytes: int, n_layer: int, plan, choose=None) -> tuple[frozenset[int], MemoryPlan]:
    """[flash] dram_budget = "fill": the most target layers, spread evenly across depth, whose
    plan stays within `limit_bytes`; `plan(resident)` is the run's MemoryPlan with those layers
    kept (each kept layer also leaves the window when no layer is streamed); `choose(k)`: which
    k layers (default: spread evenly; a live budget keeps those held: respread). Refuses, with
    the figures, a limit that streaming every layer does not fit."""
    for k in range(n_layer, -1, -1):
        chosen = choose(k) if choose is not None else frozenset(spread(n_layer, k)) if k else frozenset()
        p = plan(chosen)
        if p.total_bytes <= limit_bytes:
            return chosen, p
    raise LeverError(f"[memory] limit: {mib(limit_bytes)} does not hold this run even with every layer streamed: "
                     f"it needs {p.describe()}; {largest(p)}")


# The parts a configuration sizes, and the keys that size them: what to lower when it does not fit.
KEYS = {"resident_layer_bytes": ("resident layers", "[flash] dram_budget"), "head_bytes": ("head", "[model] target"),
        "window_bytes": ("window", "[flash] window_layers"),
        "kv_cache_bytes": ("KV cache", "[model] n_ctx or [tree_expand] max_nodes"),
        "draft_bytes": ("draft", "[model] draft or [model] n_ctx"),
        "activation_bytes": ("activations", "the prompt or [tree_expand] max_nodes")}
# (grammar_bytes is not a config's to size: it is fixed where structured output may run)


def largest(plan: MemoryPlan) -> str:
    name = max(KEYS, key=lambda k: getattr(plan, k))
    label, keys = KEYS[name]
    return f"the largest part a config sets is {label}, {mib(getattr(plan, name))}, by {keys}"


def check(plan: MemoryPlan, cfg: MemoryConfig, where: str = "config") -> None:
    """Refuse, with the figures, a plan over the configured limit or the machine's memory."""
    limit = cfg.limit_bytes
    if limit is not None and plan.total_bytes > limit:
        raise LeverError(f"{where}: [memory] limit: this run needs {plan.describe()}, over the limit of {mib(limit)}; "
                         f"{largest(plan)}")
    # The process is already resident; what it still needs must come from what is available.
    more = plan.total_bytes - plan.process_bytes
    available, whose = room_bytes()
    if more > available:
        raise LeverError(f"{where}: this run needs {plan.describe()}; {mib(more)} more than now, but {whose} "
                         f"has {mib(available)} available; {largest(plan)}")


# [memory] limit = "auto" under dram_budget = "fill": the share of the memory available now that
# resident layers may fill; the rest is left to the phone's other apps and the page cache
AUTO_FILL_SHARE = 0.75


def auto_limit_bytes() -> int:
    """What "fill" fills when [memory] limit is "auto" (`-m` with no --mem)."""
    return int(AUTO_FILL_SHARE * room_bytes()[0])


def room_bytes() -> tuple[int, str]:
    """What this process may still take, and whose bound that is: the machine's available
    memory, or its memory cgroup's limit less what the cgroup holds that cannot be reclaimed
    (its page cache can), whichever is less."""
    available = psutil.virtual_memory().available
    cgroup = _cgroup_room_bytes()
    if cgroup is not None and cgroup < available:
        return cgroup, "the memory cgroup it runs in"
    return available, "the machine"


def _cgroup_room_bytes() -> int | None:
    """cgroup v2's memory.max less memory.current's unreclaimable part (None: no limit seen)."""
    try:
        line = next(x for x in open("/proc/self/cgroup").read().splitlines() if x.startswith("0::"))
        d = "/sys/fs/cgroup" + line[3:].rstrip("/")
        limit = open(f"{d}/memory.max").read().strip()
        if limit == "max":
            return None
        current = int(open(f"{d}/memory.current").read())
        stat = dict(x.split() for x in open(f"{d}/memory.stat").read().splitlines())
        return max(int(limit) - (current - int(stat.get("file", 0))), 0)
    except (OSError, StopIteration, ValueError):
        return None

