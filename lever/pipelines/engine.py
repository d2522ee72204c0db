"""One run through a configured pipeline (`lever run`), the Engine that opens a pair once for many, and the run summary.

The summary is where the pipeline's claims are measured: tokens/s, flash bytes read from the
device per token (from /proc/self/io, not from what was asked), the share of read time hidden
under compute, time per token against the read and compute time of one pass, and peak RSS
against the DRAM the configuration accounts for.
"""

from __future__ import annotations

import copy
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait

import attrs

from lever.backends.cpu import native
from lever.backends.cpu.kv_cache import KVCache
from lever.backends.flash.device import process_read_bytes
from lever.config import PIPELINE_KINDS, Config, GenerateConfig, PipelineKind
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import read_spec
from lever.gguf.tokenizer import StreamDecoder, Tokenizer
from lever.gguf.vocab_map import VocabFigures, VocabMap, pair_vocabularies
from lever.model.sampling import SamplingParams
from lever.model.stop import StopReason
from lever.model.transformer import Model
from lever.pipelines.compose import KVState, compose
from lever.pipelines.target import FlashTarget
from lever.policy.acceptance import AcceptanceTable
from lever.policy.cost_model import CostModel, cost_model_for
from lever.policy.memory import MemoryPlan, plan_memory, runtime_bytes_for
from lever.policy.memory import check as check_memory
from lever.policy.placement import placement_for
from lever.policy.predictor import Artifact, Predictor, artifact_path, predictor_for
from lever.signals import run_async
from lever.stages.accept import StopRule
from lever.stages.tree_expand import CycleRecord, TreeExpandConfig


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
    """DRAM: what the configuration accounts for, what was planned before loading, what was used."""

    budget_bytes: int  # resident layers + head + window + KV cache + draft
    resident_layer_bytes: int
    head_bytes: int  # the output projection, resident
    window_bytes: int  # staging buffers for streamed layers
    kv_cache_bytes: int
    draft_bytes: int  # the draft model's weights and KV cache, all resident
    peak_rss_bytes: int
    plan: MemoryPlan | None = None  # lever.policy.memory's plan, checked against [memory] limit

    @property
    def rss_bound_bytes(self) -> int:
        return self.plan.rss_bound_bytes if self.plan is not None else 0


@attrs.frozen
class TreeFigures:
    """The trees and what verification made of them."""

    accepted_per_pass: float  # tokens emitted per decoding pass (1.0 for autoregressive)
    mean_nodes: float  # nodes verified per decoding pass, root included
    lookahead_hit_share: float = 0.0  # cycles that started from rows drafted ahead
    token_layers: int = 0  # nodes x layers the target computed
    layer_tokens: list[int] = attrs.field(factory=list)  # nodes computed at each target layer, decoding passes
    prune_layer: int = -1  # the pruning predictor's layer (-1: none)
    pruned_share: float = 0.0  # tree nodes (past the root) the predictor pruned
    draft_forward_tokens: dict[int, int] = attrs.field(factory=dict)  # tokens in a draft forward -> forwards
    cycles: list[CycleRecord] = attrs.field(factory=list)  # each decoding cycle, predicted and measured

    @property
    def predicted_cycle_s(self) -> float:
        return _mean(c.predicted_s for c in self.cycles)

    @property
    def measured_cycle_s(self) -> float:
        return _mean(c.measured_s for c in self.cycles)

    @property
    def predicted_tokens(self) -> float:
        return _mean(c.predicted_tokens for c in self.cycles)

    @property
    def measured_tokens(self) -> float:
        return _mean(c.tokens for c in self.cycles)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


@attrs.frozen
class RunResult:
    """One generation: its tokens, and its figures in records assembled from the stages' own."""

    pipeline: str
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    stop_reason: StopReason | None
    timing: Timing
    flash: FlashFigures
    memory: MemoryFigures
    tree: TreeFigures
    placement: dict[str, str] = attrs.field(factory=dict)  # where each stage's work ran
    channels: dict[str, dict] = attrs.field(factory=dict)  # each channel's ChannelStats (messages, backlog)
    temperature: float = 0.0  # 0: greedy, so the tokens must equal the target's own greedy decoding
    baseline: RunResult | None = None  # [pipeline] baseline run on the same prompt, when configured
    vocab: VocabFigures | None = None  # the draft's token table mapped to the target's; None: the same table (or no draft)

    @property
    def speedup(self) -> float:
        """Decode speed over the baseline's, measured in the same run (0 without one)."""
        return self.baseline.ms_per_token / self.ms_per_token if self.baseline and self.ms_per_token else 0.0

    @property
    def baseline_tokens_equal(self) -> bool | None:
        return None if self.baseline is None else self.tokens == self.baseline.tokens

    @property
    def decode_tps(self) -> float:
        return len(self.tokens[1:]) / self.timing.decode_s if self.timing.decode_s > 0 else 0.0

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
        return 1e3 * self.timing.decode_cpu_s / max(len(self.tokens) - 1, 1)

    @property
    def flash_mb_per_token(self) -> float:
        return self.flash.read_bytes / max(len(self.tokens) - 1, 1) / 1e6

    def as_json(self) -> dict:
        d = attrs.asdict(self, filter=lambda a, _: a.name != "baseline")
        d["timing"]["pass_wall_ratio"] = self.timing.pass_wall_ratio
        d["timing"]["flash_busy_share"] = self.timing.flash_busy_share
        tr = self.tree
        d["tree"].update(predicted_cycle_s=tr.predicted_cycle_s, measured_cycle_s=tr.measured_cycle_s,
                         predicted_tokens=tr.predicted_tokens, measured_tokens=tr.measured_tokens)
        d["memory"]["rss_bound_bytes"] = self.memory.rss_bound_bytes
        d.update(decode_tps=self.decode_tps, ms_per_token=self.ms_per_token, prefill_tps=self.prefill_tps, flash_mb_per_token=self.flash_mb_per_token,
                 cpu_ms_per_token=self.cpu_ms_per_token)
        if self.baseline is not None:
            d.update(baseline=self.baseline.as_json(), speedup=self.speedup, baseline_tokens_equal=self.baseline_tokens_equal)
        return d


def cost_model(cfg: Config, target_file: GGUFFile | None = None) -> CostModel:
    """The cost model a run of cfg prices trees with (lever.policy.cost_model.cost_model_for)."""
    if not cfg.model.target:
        raise LeverError(f"{cfg.where}: [model] target is not set")
    return cost_model_for(target=cfg.model.target, draft=cfg.model.draft or None, flash=cfg.flash,
                          profile=cfg.profile, emulate_layer_ms_per_token=cfg.runtime.emulate_layer_ms_per_token,
                          target_file=target_file)


def _cpu_s() -> float:
    """This process's user + system CPU seconds, every thread (the kernels' pool and the readers)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over
    execve, so a `lever run` started from a big process (a test runner) reported that one's peak."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_pipeline(cfg: Config, prompt: str, on_text=None, trace_path=None, observer=None) -> RunResult:
    """One generation through the configured pipeline; then its [pipeline] baseline, if any,
    on the same prompt (not streamed to on_text), attached to the result."""
    res = _run_kind(cfg, cfg.pipeline.kind, prompt, on_text=on_text, trace_path=trace_path, observer=observer)
    if not cfg.pipeline.baseline:
        return res
    base = _run_kind(cfg, cfg.pipeline.baseline, prompt)
    return attrs.evolve(res, baseline=base)


def _run_kind(cfg: Config, name: str, prompt: str, *, on_text=None, trace_path=None, observer=None) -> RunResult:
    with Engine.open(cfg, name, prompt=prompt) as engine:
        return engine.run(engine.encode(prompt), on_text=on_text, trace_path=trace_path, observer=observer)


@attrs.define
class Engine:
    """One pipeline's models, opened once for any number of generations: the target on the
    flash backend, the draft in DRAM, the tokenizer. `run_pipeline` opens one per run; the
    Python API (lever.api) keeps one open across calls."""

    cfg: Config
    kind: PipelineKind
    file: GGUFFile
    spec: object  # lever.gguf.spec.ModelSpec
    tok: Tokenizer
    n_ctx: int
    target: FlashTarget | None = None
    draft: Model | None = None
    draft_file: GGUFFile | None = None
    draft_spec: object | None = None
    vocab: VocabMap | None = None  # the draft's token table mapped to the target's; None: the same table
    _cost: CostModel | None = None

    @classmethod
    def open(cls, cfg: Config, name: str | None = None, *, prompt: str | None = None) -> Engine:
        """Headers and tokenizer first, then the memory plan for `prompt` (or for a tree pass
        when none is known yet) is checked before anything is loaded."""
        kind = PIPELINE_KINDS[name or cfg.pipeline.kind]
        if not cfg.model.target:
            raise LeverError(f"{cfg.where}: [model] target: no target model given")
        f = GGUFFile(cfg.model.target)
        spec = read_spec(f)
        engine = cls(cfg, kind, f, spec, Tokenizer.from_gguf(f), min(cfg.model.n_ctx, spec.n_ctx_train))
        if kind.speculates and cfg.tree_expand.drafts:  # sources without "model" need none (lever.policy.lookup)
            if not cfg.model.draft:
                raise LeverError(f"{cfg.where}: [model] draft: a speculative pipeline needs a draft model "
                                 "(or [tree_expand] sources without \"model\")")
            engine.draft_file = GGUFFile(cfg.model.draft)
            engine.draft_spec = read_spec(engine.draft_file)
            # another tokenizer is refused, another table of the same one mapped, once, here (each
            # generation's compose is handed the map), special ids that differ warned: see lever.gguf.vocab_map
            engine.vocab, warnings = pair_vocabularies(f, engine.draft_file)
            for line in warnings:
                print(f"lever: warning: {line}", file=sys.stderr)
        engine.plan(len(engine.encode(prompt)) if prompt is not None else 1)
        with native.default_threads(cfg.runtime.threads), ThreadPoolExecutor(1, "lever-load") as pool:
            # the draft loads beside the target: both are mostly reads and packing in the
            # kernels (which release the GIL), and the first token waits for both
            draft = pool.submit(Model, file=engine.draft_file) if engine.draft_file is not None else None
            try:
                engine.target = FlashTarget.open(cfg.model.target, engine.flash, file=f)
                # resident: read (not mapped) and packed, so its file may change under a long run without harm
                engine.draft = draft.result() if draft is not None else None
            except BaseException:
                if draft is not None:
                    draft.cancel()
                    wait([draft])
                engine.close()
                raise
        return engine

    @property
    def cost(self) -> CostModel | None:
        """The cost model trees are priced with, made once (it reads the profile and the
        target's tensor table); None for pipelines that draft nothing."""
        if self._cost is None and self.kind.speculates:
            self._cost = cost_model(self.cfg, self.file)
        return self._cost

    @property
    def flash(self):
        return attrs.evolve(self.cfg.flash, dram_budget=1.0) if self.kind.all_resident else self.cfg.flash

    @property
    def tree(self) -> TreeExpandConfig:
        return self.cfg.tree_expand if self.kind.speculates else TreeExpandConfig(policy="none")

    def encode(self, prompt: str) -> list[int]:
        ids = self.tok.encode(prompt)
        if not ids:
            raise LeverError("empty prompt")
        return ids

    def plan(self, n_prompt: int, n_past: int = 0) -> MemoryPlan:
        """The memory plan of a generation prefilling n_prompt tokens after n_past already
        cached, checked against [memory] limit: made before the generation allocates anything."""
        if n_past + n_prompt >= self.n_ctx:
            raise LeverError(f"prompt is {n_past + n_prompt} tokens, over the context of {self.n_ctx} ([model] n_ctx)")
        tree = self.tree
        plan = plan_memory(self.file, self.spec, self.flash, n_ctx=self.n_ctx, n_pass_tokens=max(n_prompt, tree.max_nodes),
                           tree_rows=tree.max_nodes, draft=self.draft_file, draft_spec=self.draft_spec,
                           draft_rows=tree.draft_rows if self.kind.speculates else 0,
                           runtime_bytes=runtime_bytes_for(self.cfg.placement))
        check_memory(plan, self.cfg.memory, self.cfg.where)
        return plan

    def run(self, prompt_ids: list[int], *, on_text=None, trace_path=None, observer=None,
            generate: GenerateConfig | None = None, stop: StopRule | None = None, kv: KVState | None = None,
            on_kv=None, history=()) -> RunResult:
        """One generation from prompt_ids (`generate`: this call's [generate] settings; `stop`:
        a rule that may end it early, as a stop string or a cancelled request does). With `kv`
        (a session's caches, from an earlier run's `on_kv(KVState)`), prompt_ids continue the
        text the caches hold and only they are prefilled (`history`: that text's tokens, which
        the repeat penalty looks back on)."""
        if self.target is None:
            raise LeverError(f"{self.cfg.where}: the engine is closed")
        n_past = kv.n_rows if kv is not None else 0
        plan = self.plan(len(prompt_ids), n_past)
        cfg = self.cfg if generate is None else attrs.evolve(self.cfg, generate=generate)
        with native.default_threads(cfg.runtime.threads):
            return _run(cfg, self.kind, self.target, tok=self.tok, prompt_ids=prompt_ids, n_ctx=self.n_ctx, plan=plan,
                        draft=self.draft, vocab=self.vocab, on_text=on_text, trace_path=trace_path, observer=observer,
                        stop=stop, kv=kv, on_kv=on_kv, cost=self.cost, history=history)

    def new_kv(self) -> KVState:
        """Empty caches of the sizes a run of this engine makes (for a session read from disk)."""
        tree = self.tree
        draft = self.draft.new_cache(self.n_ctx + tree.draft_rows) if self.draft is not None and self.kind.speculates else None
        return KVState(KVCache(self.spec, self.n_ctx + tree.max_nodes), draft, 0)

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
            self.target = None
        self.draft = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _qnn_figures(runner) -> str:
    """A QNN runner's padding waste and sessions, for the summary."""
    pad, ses = runner.padding, runner.sessions_stats
    return (f"{pad.calls} layer calls, padding waste {100 * pad.tok_waste:.0f}% of token rows and "
            f"{100 * pad.kv_waste:.0f}% of KV rows, {ses.created} sessions compiled, {ses.loaded} loaded from cache")


def _predictor(cfg: Config, target: FlashTarget, cost) -> tuple[Predictor | None, AcceptanceTable | None]:
    """The pruning predictor ([predictor] enabled) and TreeExpand's starting calibration
    ([tree_expand] acceptance = "calibrated"), from `lever calibrate`'s artifact."""
    pc, want_table = cfg.predictor, cfg.tree_expand.acceptance == "calibrated"
    if not pc.enabled and not want_table:
        return None, None
    path = cfg.model.target
    art = None
    if want_table or pc.layer < 0 or pc.threshold < 0:
        art = Artifact.read(artifact_path(pc.artifact, path), path)
    pred = predictor_for(pc, target.model, art, cost) if pc.enabled else None
    return pred, copy.deepcopy(art.acceptance) if want_table else None


def _run(cfg: Config, kind: PipelineKind, target: FlashTarget, *, tok: Tokenizer, prompt_ids: list[int], n_ctx: int,
         plan: MemoryPlan, draft: Model | None, vocab: VocabMap | None, on_text, trace_path, observer,
         stop: StopRule | None = None, kv: KVState | None = None, on_kv=None, cost: CostModel | None = None,
         history=()) -> RunResult:
    spec = target.model.spec
    g = cfg.generate
    params = SamplingParams(g.temperature, g.top_k, g.top_p, None if g.seed < 0 else g.seed, g.min_p, g.repeat_penalty,
                            g.repeat_last_n)
    tracer = Tracer(keep_spans=bool(trace_path))
    stream = StreamDecoder(tok, at_start=False)
    t_first: list[float] = []
    cpu_first: list[float] = []  # the process's CPU seconds at the first token: decoding's start

    def on_tokens(ts):
        if not t_first:
            t_first.append(time.perf_counter())
            cpu_first.append(_cpu_s())
        if on_text:
            on_text("".join(stream.push(t) for t in ts))

    tree = cfg.tree_expand if kind.speculates else None
    cost = (cost or cost_model(cfg)) if kind.speculates else None
    predictor, acceptance = _predictor(cfg, target, cost) if kind.speculates else (None, None)
    place = placement_for(cfg.placement, cfg.qnn, flash_mode=cfg.flash.mode, target_spec=spec,
                          draft_spec=draft.spec if draft is not None else None, n_ctx=n_ctx)
    h = compose(target, prompt_ids, cfg=cfg, params=params, eos_ids=frozenset(tok.eos_ids), n_ctx=n_ctx, tracer=tracer,
                on_tokens=on_tokens, draft_model=draft, vocab=vocab, tree=tree, cost=cost, predictor=predictor,
                acceptance=acceptance, observer=observer, placement=place, stop=stop, kv=kv, history=history)
    target.warm_head()
    target.store.reset_stats()
    dev0 = process_read_bytes() or 0
    t0 = time.perf_counter()
    run_async(h.pipeline.run)
    t1, cpu1 = time.perf_counter(), _cpu_s()
    if on_kv is not None:
        on_kv(h.kv_after())
    if on_text:
        on_text(stream.flush())
    dev_bytes = (process_read_bytes() or 0) - dev0
    out, trees, verified = h.output.stats(), h.expand.stats(), h.verify.stats()
    drafted = h.draft.stats() if h.draft is not None else None
    n_passes = len(out.accepted_per_pass)
    summary = tracer.summary()
    draft_bytes = drafted.weights_bytes + drafted.kv_cache_bytes if drafted is not None else 0
    # The prefill pass reads the layers once too; decoding is the passes after it.
    decode_passes = max(n_passes - 1, 1)
    per_pass_bytes = target.store.streamed_bytes
    store = target.store.stats()
    if trace_path:
        tracer.write_chrome(trace_path)
    first = t_first[0] if t_first else t1
    timing = Timing(prefill_s=first - t0, decode_s=t1 - first, n_passes=n_passes, stage_s=summary.stage_s,
                    io_s=summary.io_s, compute_s=summary.compute_s, overlap_share=summary.overlap_share,
                    verify_pass_s=summary.pass_s(h.verify.name),
                    draft_s=summary.stage_s.get(h.draft.name, 0.0) if h.draft else 0.0,
                    accept_s=summary.stage_s.get(h.accept.name, 0.0),
                    draft_hidden_share=summary.hidden_share(h.draft.name, h.verify.name) if h.draft else 0.0,
                    decode_cpu_s=cpu1 - (cpu_first[0] if cpu_first else cpu1))
    flash = FlashFigures(per_pass_bytes, max(dev_bytes - per_pass_bytes, 0) if n_passes > 1 else dev_bytes,
                         store.requested_bytes, summary.flash_gbps)
    memory = MemoryFigures(
        budget_bytes=target.resident_bytes + target.head_bytes + target.window_bytes + verified.kv_cache_bytes
        + draft_bytes, resident_layer_bytes=target.resident_bytes, head_bytes=target.head_bytes,
        window_bytes=target.window_bytes, kv_cache_bytes=verified.kv_cache_bytes, draft_bytes=draft_bytes,
        peak_rss_bytes=_peak_rss_bytes(), plan=plan)
    trees_run = TreeFigures(
        accepted_per_pass=sum(out.accepted_per_pass[1:]) / decode_passes if n_passes > 1 else 0.0,
        mean_nodes=trees.mean_nodes, lookahead_hit_share=trees.lookahead_hit_share,
        token_layers=verified.token_layers, layer_tokens=list(verified.layer_tokens),
        prune_layer=verified.prune_layer, pruned_share=verified.pruned_share,
        draft_forward_tokens=drafted.forward_tokens if drafted is not None else {}, cycles=list(trees.cycles))
    return RunResult(
        pipeline=kind.name if tree is None else f"{kind.name}/{tree.policy}", prompt_tokens=prompt_ids,
        tokens=list(out.tokens), text="".join(StreamDecoder(tok, at_start=False).push(t) for t in out.tokens),
        stop_reason=out.stop_reason, timing=timing, flash=flash, memory=memory, tree=trees_run,
        placement=place.where | {f"qnn {i}": _qnn_figures(r) for i, r in enumerate(place.runners)},
        channels={k: attrs.asdict(v) for k, v in h.pipeline.channel_stats.items()}, temperature=g.temperature,
        vocab=h.draft.core.vocab.figures if h.draft is not None and h.draft.core.vocab is not None else None,
    )
