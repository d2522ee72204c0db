"""The Engine: a pipeline's models opened once, and one generation run through them (`lever run`).

`Engine.open` resolves the config into a RunPlan (lever.pipelines.plan), checks the memory plan
of a first generation before anything is loaded, then loads the target onto the flash backend
and the draft into DRAM. `Engine.run` composes a generation's graph from the plan and a Request
(lever.pipelines.compose), runs it, and measures it: tokens/s, flash bytes read from the device
per token (from /proc/self/io, not from what was asked), the share of read time hidden under
compute, and peak RSS against the memory plan (lever.pipelines.result). `run_pipeline` is
`lever run`'s: one engine per run, then the [pipeline] baseline on the same prompt.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import attrs
import psutil

from lever.backends.cpu import native
from lever.backends.cpu.kv_cache import KVCache
from lever.backends.flash.device import process_read_bytes
from lever.config import Config
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer
from lever.model.grammar import Grammar, compile_args, matcher_limits
from lever.model.grammar_child import CompileProcess
from lever.model.transformer import Model
from lever.pipelines.batcher import WAIT_S, Batcher, StreamedLayers
from lever.pipelines.compose import KVState, Request, compose
from lever.pipelines.memory_watch import Cgroup, MemoryWatch
from lever.pipelines.plan import RunPlan
from lever.pipelines.residency import MemoryChange, give_back
from lever.pipelines.result import FlashFigures, MemoryFigures, RunResult, Timing
from lever.pipelines.target import FlashTarget
from lever.pipelines.text import TextStream
from lever.policy.memory import MemoryPlan
from lever.policy.memory import check as check_memory
from lever.signals import run_async


def run_pipeline(cfg: Config, prompt: str, on_text=None, trace_path=None, observer=None,
                 constrain: dict | None = None) -> RunResult:
    """One generation through the configured pipeline; then its [pipeline] baseline, if any,
    on the same prompt (not streamed to on_text), attached to the result. `constrain`: a
    `grammar` or `json_schema` the text must follow (lever.model.grammar.compile_args),
    compiled once for both, before the plan that counts what it holds."""
    grammar = compiled(cfg, constrain) if constrain else None
    res = _run_kind(cfg, cfg.pipeline.kind, prompt, on_text=on_text, trace_path=trace_path, observer=observer,
                    grammar=grammar)
    if not cfg.pipeline.baseline:
        return res
    base = _run_kind(cfg, cfg.pipeline.baseline, prompt, grammar=grammar)
    return attrs.evolve(res, baseline=base)


def compiled(cfg: Config, constrain: dict) -> Grammar:
    """A run's grammar for the config's target, compiled in a child first (its time, memory
    and crashes bounded: lever.model.grammar_child), before any model loads."""
    if not cfg.model.target:
        raise LeverError(f"{cfg.where}: [model] target: no target model given")
    tok = Tokenizer.from_gguf(cfg.model.target)
    with CompileProcess(tok.vocab_size, dict(tok.specials), tok.eos_id, limits=matcher_limits()) as compiler:
        return compile_args(tok, **constrain, compiler=compiler)


def _run_kind(cfg: Config, name: str, prompt: str, *, on_text=None, trace_path=None, observer=None,
              grammar: Grammar | None = None) -> RunResult:
    with Engine.open(cfg, name, prompt=prompt, grammars=grammar or False,
                     tok=grammar.tok if grammar is not None else None, follow=True) as engine:
        res = engine.run(Request(engine.encode(prompt), observer=observer, grammar=grammar), on_text=on_text,
                         trace_path=trace_path)
        if (watch := engine.memory_watch) is None:
            return res
        t0 = res.timing.started_s
        return attrs.evolve(res, memory_events=tuple((t - t0, what, n) for t, what, n in watch.events))


@attrs.define
class Engine:
    """One pipeline's models, opened once for any number of generations: the target on the
    flash backend, the draft in DRAM, both from one RunPlan. `run_pipeline` opens one per run;
    the Python API (lever.api) keeps one open across calls."""

    plan: RunPlan
    target: FlashTarget | None = None
    draft: Model | None = None  # None: the plan does not draft
    # the process before loading (interpreter, libraries, tokenizer): a plan made after loading
    # must not count the loaded weights twice, once as their parts and once in the process's RSS
    process_bytes: int | None = None
    memory_watch: MemoryWatch | None = None  # the system's grant followed (Engine.open's `follow`)
    _learners: list[weakref.ref] = attrs.field(factory=list)  # generations' tree pricing (set_memory reprices)
    _memory_lock: threading.Lock = attrs.field(factory=threading.Lock)

    @classmethod
    def open(cls, cfg: Config, name: str | None = None, *, prompt: str | None = None,
             grammars: bool | Grammar = False, tok: Tokenizer | None = None, follow: bool = False) -> Engine:
        """The plan first (headers and tokenizer, nothing loaded), then the memory plan for
        `prompt` (or for a tree pass when none is known yet) is checked, then the models load.
        `grammars`: structured output may run, or this grammar will (its part of the plan:
        RunPlan.resolve); `tok`: the target's tokenizer, when the caller has it already.
        `follow`: the memory the system grants is followed from before the resident layers
        load (`memory_watch`, stopped by `close`): a cap that falls while they are read takes
        effect at the next layer, where the kernel would kill a load that went on to its plan."""
        plan = RunPlan.resolve(cfg, name, grammars=grammars, tok=tok)
        for line in plan.warnings:
            print(f"lever: warning: {line}", file=sys.stderr)
        # the process as the plan priced it: a fill's resident layers were chosen against the process
        # of that moment, and the few pages it grew since must not turn the plan it made into a refusal
        rss = psutil.Process().memory_info().rss
        engine = cls(plan, process_bytes=plan.fill.process_bytes if plan.fill is not None else rss)
        engine.memory_plan(len(engine.encode(prompt)) if prompt is not None else 1)
        with native.default_threads(plan.runtime.threads), ThreadPoolExecutor(1, "lever-load") as pool:
            # the draft loads beside the target: both are mostly reads and packing in the
            # kernels (which release the GIL), and the first token waits for both
            draft = pool.submit(Model, file=plan.draft_file) if plan.drafts else None
            try:
                # resident layers: read (not mapped) and packed, so the file may change under a long run without
                # harm; they grow in the background, under the watch, while the draft loads
                engine.target = FlashTarget.open(plan.target_file.path, plan.flash, file=plan.target_file,
                                                 resident=frozenset())
                engine.memory_watch = engine.watch_memory() if follow else None
                if engine.memory_watch is not None:
                    engine.memory_watch.start()
                engine.target.resident.resize(engine.plan.resident)  # the plan the watch made, if it moved it
                engine.draft = draft.result() if draft is not None else None
                engine.target.resident.wait_grown()
                if (e := engine.target.resident.grow_error) is not None:
                    raise e
            except BaseException:
                if draft is not None:
                    draft.cancel()
                    wait([draft])
                engine.close()
                raise
        return engine

    @property
    def tok(self) -> Tokenizer:
        return self.plan.tok

    @property
    def n_ctx(self) -> int:
        return self.plan.n_ctx

    @property
    def n_ctx_source(self) -> str:
        """Which limit sets the context: the config's [model] n_ctx, or the target's own."""
        p = self.plan
        if p.n_ctx < p.spec.n_ctx_train:
            return "[model] n_ctx"
        return f"the target's context_length, {p.target_file.path.name}"

    def encode(self, prompt: str) -> list[int]:
        ids = self.tok.encode(prompt)
        if not ids:
            raise LeverError("empty prompt")
        return ids

    def memory_plan(self, n_prompt: int, n_past: int = 0) -> MemoryPlan:
        """The memory plan of a generation prefilling n_prompt tokens after n_past already
        cached, checked against [memory] limit: made before the generation allocates anything."""
        p = self.plan
        if n_past + n_prompt >= p.n_ctx:
            raise LeverError(f"prompt: {n_past + n_prompt} tokens exceeds the available context size of {p.n_ctx} "
                             f"({self.n_ctx_source})")
        mem = p.memory_plan(n_prompt, self.process_bytes)
        check_memory(mem, p.memory, p.where)
        return mem

    def run(self, request: Request, *, on_text=None, trace_path=None, on_kv=None) -> RunResult:
        """One generation (lever.pipelines.compose.Request: its ids, [generate] settings, stop
        rule, a session's caches). `on_text`: the decoded text as it comes; `trace_path`: a
        Chrome/Perfetto trace of the run; `on_kv(KVState)`: the caches after it, for a session
        to continue from (the result holds none: a kept result must not keep a context's rows)."""
        if self.target is None:
            raise LeverError(f"{self.plan.where}: the engine is closed")
        mem = self.memory_plan(len(request.ids), request.kv.n_rows if request.kv is not None else 0)
        with native.default_threads(self.plan.runtime.threads):
            return _run(self, request, mem, on_text=on_text, trace_path=trace_path, on_kv=on_kv)

    def set_memory(self, limit_bytes: int) -> MemoryChange:
        """The DRAM this engine may hold from now on (issue 50), from any thread, running or not:
        the resident layers re-planned as --mem fills them (RunPlan.refill), those dropped freed
        at once (a pass planned to find one reads it itself), those added read back in the
        background; running generations price their next trees by the reads that leave. Below
        the floor (every layer streamed) every layer is dropped, and the passes stop with one
        line naming the cap and the floor (raised here too) rather than the process be killed."""
        t = self.target
        if t is None:
            raise LeverError(f"{self.plan.where}: the engine is closed")
        with self._memory_lock:
            t0, held = time.perf_counter(), t.resident.keys()
            try:
                chosen, mem = self.plan.refill(limit_bytes, held, self.process_bytes)
            except LeverError as e:
                t.resident.stopped = LeverError(str(e))  # without the frames of this call
                t.resident.resize(())
                raise
            t.resident.stopped = None
            freed = t.resident.resize(chosen)
            self.plan = self.plan.with_resident(chosen, limit_bytes)
            if self.plan.cost is not None:
                for ref in list(self._learners):
                    if (learner := ref()) is not None:
                        learner.reprice(self.plan.cost.layer_read_bytes)
            return MemoryChange(limit_bytes, len(held), len(chosen), freed, mem, time.perf_counter() - t0,
                                *self.plan.live_bounds(self.process_bytes))

    def squeeze(self) -> int:
        """Drops every resident layer now (the run's floor), the plan's limit kept: what memory
        pressure asks before the limit behind it can be read (lever.pipelines.memory_watch).
        The bytes freed."""
        t = self.target
        if t is None:
            return 0
        with self._memory_lock:
            freed = t.resident.resize(())
            self.plan = self.plan.with_resident(frozenset(), self.plan.memory.limit_bytes)
            return freed

    def stop_at_floor(self) -> None:
        """Memory pressure went on with every layer dropped: the cap behind it (which cgroup v1
        does not show until it is met) is below this run's floor. The passes stop with one line
        at their next layer, rather than the process be killed."""
        t = self.target
        if t is None:
            return
        floor = self.plan.live_bounds(self.process_bytes)[0]
        t.resident.stopped = LeverError(
            f"memory: the memory cgroup's cap fell below this run's floor of {floor >> 20} MiB (every layer "
            f"streamed): pressure went on with every layer dropped, so it stops rather than be killed")

    def watch_memory(self) -> MemoryWatch | None:
        """A MemoryWatch over this process's memory cgroup (where it has one) and the scripts'
        signals, moving this engine's budget (not started); None where it does not apply:
        [memory] follow off, or resident layers not filling a limit."""
        if not self.plan.memory.follow or self.plan.fill is None:
            return None
        return MemoryWatch(Cgroup.of_process(), self.set_memory, self.squeeze, self.stop_at_floor,
                           own_limit_bytes=self.plan.memory.limit_bytes)

    def batcher(self, wait_s: float | None = None) -> Batcher:
        """A Batcher over this engine's target: generations run with it (Request.batcher), each in
        its own thread between `join` and `leave`, verify their trees in shared passes, each
        streamed layer read once per pass for all of them, through the target's own window
        (lever.pipelines.batcher). `wait_s`: how long a pass waits for the other generations'
        trees; by default what a pass costs whatever its tree (the cost model's pass of one
        token: the read of the streamed layers, the resident ones' weights), which is what a
        tree joining it saves, so a wait never costs more than it can gain."""
        t = self.target
        if t is None:
            raise LeverError(f"{self.plan.where}: the engine is closed")
        if wait_s is None:
            wait_s = self.plan.cost.verify_s(1) if self.plan.cost is not None else WAIT_S
        price = self.plan.cost.verify_s if self.plan.cost is not None else None
        return Batcher(lambda: StreamedLayers(t.store, t.model.file, self.plan.spec, t.resident), wait_s=wait_s,
                       price=price)

    def new_kv(self) -> KVState:
        """Empty caches of the sizes a run of this engine makes (for a session read from disk)."""
        p = self.plan
        draft = self.draft.new_cache(p.n_ctx + p.tree.draft_rows) if self.draft is not None else None
        return KVState(KVCache(p.spec, p.n_ctx + p.tree.max_nodes), draft, 0)

    def close(self) -> None:
        if self.memory_watch is not None:
            self.memory_watch.stop()
            self.memory_watch = None
        if self.target is not None:
            self.target.close()
            self.target = None
        self.draft = None
        give_back()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def _qnn_figures(runner) -> str:
    """A QNN runner's padding waste and sessions, for the summary."""
    pad, ses = runner.padding, runner.sessions_stats
    return (f"{pad.calls} layer calls, padding waste {100 * pad.tok_waste:.0f}% of token rows and "
            f"{100 * pad.kv_waste:.0f}% of KV rows, {ses.created} sessions compiled, {ses.loaded} loaded from cache")


@attrs.define
class _Emissions:
    """A run's emitted tokens as they come, passed on: when decoding began (wall and CPU seconds
    at the first token) and each pass's tokens by the time they came (tok/s over time)."""

    forward: Callable | None  # the request's own on_tokens
    started_s: float = attrs.field(factory=time.monotonic)
    first: tuple[float, float] | None = None
    emits: list[tuple[float, int]] = attrs.field(factory=list)  # (s since started_s, tokens)

    def __call__(self, ts) -> None:
        if self.first is None:
            self.first = (time.perf_counter(), _cpu_s())
        self.emits.append((time.monotonic() - self.started_s, len(ts)))
        if self.forward is not None:
            self.forward(ts)


def _run(engine: Engine, request: Request, mem: MemoryPlan, *, on_text, trace_path, on_kv) -> RunResult:
    """Composes the request's graph, runs it, and measures what the stages cannot: the clocks
    (prefill ends at the first emitted token), the device's bytes, peak RSS."""
    plan, target = engine.plan, engine.target
    text = request.text  # the text's one door (lever.pipelines.text): the caller's, or one printing to on_text
    if text is None:
        text = TextStream(engine.tok, on_text=(lambda piece, n, lps: on_text(piece)) if on_text else None,
                          eos_ids=plan.eos_ids)
    on_tokens = _Emissions(request.on_tokens)
    watch = request.watch
    tracer = Tracer(keep_spans=bool(trace_path), on_span=watch.span if watch is not None else None)  # the run's own
    if watch is not None:
        watch.begin(t0_s=tracer.t0, pipeline=plan.pipeline, n_prompt=len(request.ids),
                    n_past=request.kv.n_rows if request.kv is not None else 0)
    h = compose(target, engine.draft, plan, attrs.evolve(request, on_tokens=on_tokens, tracer=tracer, text=text))
    engine._learners[:] = [r for r in engine._learners if r() is not None] + [weakref.ref(h.expand.cycle.learner)]
    target.warm_head()
    if request.batcher is None:  # else the store and the process's counter are every sharing request's
        target.store.reset_stats()
    dev0, t0 = process_read_bytes() or 0, time.perf_counter()
    try:
        run_async(h.pipeline.run)
    finally:
        shares = request.batcher.take_shares(h.verify) if request.batcher is not None else None
    t1, cpu1 = time.perf_counter(), _cpu_s()
    if on_kv is not None:
        on_kv(h.kv_after())
    if request.text is None:  # the caller's own is the caller's to finish
        text.finish()
    dev_bytes = (process_read_bytes() or 0) - dev0
    out = h.output.stats()
    n_passes = len(out.accepted_per_pass)
    summary = tracer.summary()
    if trace_path:
        tracer.write_chrome(trace_path)
    t_first, cpu_first = on_tokens.first or (t1, cpu1)
    timing = attrs.evolve(_timing(h, summary, n_passes=n_passes, t0=t0, t_first=t_first, t1=t1, cpu_s=cpu1 - cpu_first),
                          emits_s=tuple(on_tokens.emits), started_s=on_tokens.started_s)
    flash = _flash(target, shares=shares, dev_bytes=dev_bytes, n_passes=n_passes, gbps=summary.flash_gbps)
    memory = MemoryFigures(target.resident_bytes, target.head_bytes, target.window_bytes, _peak_rss_bytes(), mem,
                           fill=plan.fill)
    if watch is not None:
        watch.end(stop_reason=str(out.stop_reason) if out.stop_reason is not None else None, n_tokens=len(out.tokens),
                  tokens_per_pass=out.tokens_per_pass, decode_s=timing.decode_s)
    place = plan.placement
    gen = request.generate or plan.generate
    return RunResult(
        pipeline=plan.pipeline, prompt_tokens=list(request.ids),
        text=text.final_text, output=out,
        trees=h.expand.stats(), verify=h.verify.stats(), draft=h.draft.stats() if h.draft is not None else None,
        timing=timing, flash=flash, memory=memory,
        placement=place.where | {f"qnn {i}": _qnn_figures(r) for i, r in enumerate(place.runners)},
        channels={k: attrs.asdict(v) for k, v in h.pipeline.channel_stats.items()}, temperature=gen.temperature,
        vocab=plan.vocab.figures if plan.vocab is not None and h.draft is not None else None,
        grammar=h.constraint.stats if h.constraint is not None else None)


def _flash(target: FlashTarget, *, shares: list[int] | None, dev_bytes: int, n_passes: int,
           gbps: float) -> FlashFigures:
    """The run's reads: the process's counter and the store's, or, where passes were shared with
    other requests (`shares`), its share of each of its passes' reads. The prefill pass reads the
    layers once too; decoding is the passes after it."""
    per_pass_bytes = target.store.streamed_bytes
    if shares is not None:
        return FlashFigures(per_pass_bytes, sum(shares[1:]) if n_passes > 1 else sum(shares), sum(shares), gbps)
    return FlashFigures(per_pass_bytes, max(dev_bytes - per_pass_bytes, 0) if n_passes > 1 else dev_bytes,
                        target.store.stats().requested_bytes, gbps)


def _timing(h, summary, *, n_passes: int, t0: float, t_first: float, t1: float, cpu_s: float) -> Timing:
    """The run's clocks (prefill ends at the first emitted token) and where its stages' time went."""
    d = h.draft.name if h.draft is not None else None
    return Timing(prefill_s=t_first - t0, decode_s=t1 - t_first, n_passes=n_passes, stage_s=summary.stage_s,
                  io_s=summary.io_s, compute_s=summary.compute_s, overlap_share=summary.overlap_share,
                  verify_pass_s=summary.pass_s(h.verify.name), draft_s=summary.stage_s.get(d, 0.0) if d else 0.0,
                  accept_s=summary.stage_s.get(h.accept.name, 0.0),
                  draft_hidden_share=summary.hidden_share(d, h.verify.name) if d else 0.0, decode_cpu_s=cpu_s)
