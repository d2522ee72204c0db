"""Compositions of stages: the pipelines a config can name, built in a few lines each.

`compose(target, draft, plan, request)` joins TreeExpand, Draft, Prefetch, PrunedVerify, Accept
and Output from a resolved run (lever.pipelines.plan.RunPlan) and one generation's `Request`:
with TreeExpand's policy "none" and no Draft it is Flash-AR, the paper's baseline
(memory-resident AR is the same with a 100% DRAM budget); with a draft model and a tree policy it
is speculative decoding: chain (Chain-SD), kary, or gain-cost (Lever). A custom pipeline is the
same few `connect` calls (see examples/custom_pipeline.py).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import anyio
import attrs
import numpy as np

from lever.backends.cpu.kv_cache import KVCache
from lever.backends.flash import FlashConfig, FlashStore
from lever.config import GenerateConfig
from lever.dataflow.compute import ComputeSlot
from lever.dataflow.graph import Pipeline
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import read_spec
from lever.gguf.vocab_map import VocabMap
from lever.model.grammar import Constraint, Grammar
from lever.model.sampling import BIAS, LogitBias, SamplingParams
from lever.model.transformer import Model
from lever.pipelines.batcher import Batcher
from lever.pipelines.plan import RunPlan
from lever.pipelines.target import FlashTarget
from lever.pipelines.text import TextStream
from lever.pipelines.watch import RunWatch
from lever.policy.predictor import predictor_for
from lever.signals import run_async
from lever.stages.accept import Accept, AcceptConfig
from lever.stages.draft import Draft, Drafter
from lever.stages.drain import Drain
from lever.stages.output import Output
from lever.stages.prefetch import Prefetch
from lever.stages.pruned_verify import PrunedVerify
from lever.stages.tree_expand import TreeExpand
from lever.tree.cycle import TreeCycle


@attrs.define
class KVState:
    """Both models' KV caches and how many rows of the text they hold, in order: what a session
    keeps between generations so the next one prefills only what is new."""

    target: KVCache
    draft: KVCache | None
    n_rows: int  # rows [0, n_rows) of both caches are the first n_rows tokens of the text

    def truncate(self, n_rows: int) -> None:
        """Back to the first n_rows tokens (a rewound or edited conversation)."""
        self.n_rows = min(self.n_rows, n_rows)
        self.target.truncate(self.n_rows)
        if self.draft is not None:
            self.draft.truncate(self.n_rows)


@attrs.define
class Composition:
    """What a caller reads after a run."""

    pipeline: Pipeline
    output: Output
    verify: PrunedVerify
    accept: Accept
    expand: TreeExpand
    draft: Draft | None
    tracer: Tracer
    constraint: Constraint | None = None  # the request's grammar state, for its figures

    def kv_after(self) -> KVState:
        """The caches after the run, cut to the rows both hold as text: the target's before its
        last pass, the draft's committed ones (the last cycle's are still pending in both)."""
        n = self.verify.n_committed
        if self.draft is not None:
            n = min(n, self.draft.core.n_committed)
        kv = KVState(self.verify.cache, self.draft.core.cache if self.draft is not None else None, n)
        kv.truncate(n)
        return kv


@attrs.frozen
class Request:
    """One generation asked of a composed pipeline: the prompt's ids (continuing the text `kv`
    holds, when given), how to generate, when to stop early, and who hears about it."""

    ids: tuple[int, ...] = attrs.field(converter=tuple)  # prefilled this run
    generate: GenerateConfig | None = None  # n_predict and the sampling knobs; None: the plan's [generate]
    text: TextStream | None = None  # the text's one door (stop strings, a cancelled request); None: Engine.run's
    kv: KVState | None = None  # a session's caches, holding the text before `ids`; None: fresh ones
    history: tuple[int, ...] = attrs.field(default=(), converter=tuple)  # the text `kv` holds, for the penalties
    on_tokens: Callable[[tuple[int, ...]], None] | None = None  # each pass's emitted tokens
    logprobs: int | None = None  # each token's logprob and this many alternatives' (lever.stages.accept)
    grammar: Grammar | None = None  # a grammar the generated text must follow (lever.model.grammar)
    observer: Callable | None = None  # PrunedVerify's per-layer observer (`lever calibrate` records through it)
    watch: RunWatch | None = None  # sees each cycle and span as the run goes (a live page: lever.pipelines.watch)
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))  # the stages' spans (Engine.run: its own)
    batcher: Batcher | None = None  # passes shared with other requests' (lever.pipelines.batcher); None: its own


def compose(target: FlashTarget, draft: Model | None, plan: RunPlan, request: Request) -> Composition:
    """The pipeline of `plan` over `request`, with the opened target and draft (None when the
    plan does not draft). With `request.kv`, the ids continue the text those caches hold
    (`kv.n_rows` tokens) and only they are prefilled."""
    spec, tree, kv, tracer = target.model.spec, plan.tree, request.kv, request.tracer
    gen = request.generate or plan.generate
    params = gen.params(plan.eos_ids)  # ignore_eos: the end tokens banned by the logit bias
    params.logit_bias.check(spec.n_vocab)
    n_past = kv.n_rows if kv is not None else 0
    if (tree.adapt or tree.price_shared) and not params.exact_match and params.seed is not None:
        # rejection draws follow the trees, and the trees the machine's timing: a seed must
        # give the same text every time, so such a run prices trees by the profile, alone
        tree = attrs.evolve(tree, adapt=False, price_shared=False)
    constraint = request.grammar.constraint(spec.n_vocab) if request.grammar is not None else None
    compute = ComputeSlot(plan.runtime.ahead_cores)  # verification first; drafting ahead beside it or in turns
    cycle = TreeCycle.for_run(tree, list(request.ids), cost=plan.cost, n_ctx=plan.n_ctx, n_predict=gen.n_predict,
                              acceptance=plan.new_acceptance(), ahead_beside=bool(compute.ahead_cores),
                              committed=n_past, greedy=params.exact_match, constraint=constraint)
    expand = TreeExpand("tree_expand", cycle, tracer)
    prefetch = Prefetch("prefetch", target.store, target.model.file, spec,
                        anyio.CapacityLimiter(plan.flash.queue_depth), tracer)
    predictor = predictor_for(plan.pruning, target.model, plan.cost) if plan.pruning is not None else None
    verify = PrunedVerify(name="verify", spec=spec, embed=target.embed,
                          cache=kv.target if kv is not None else KVCache(spec, plan.n_ctx + tree.max_nodes),
                          resident=target.resident, slot=compute, predictor=predictor, tracer=tracer,
                          observer=request.observer,
                          emulate_layer_s_per_token=plan.runtime.emulate_layer_ms_per_token / 1e3,
                          layer_fn=plan.placement.verify_fn,
                          shared_pass=request.batcher.verify if request.batcher is not None else None)
    if request.batcher is not None and tree.price_shared:
        cycle.others = functools.partial(request.batcher.others, verify)
    stops = AcceptConfig(gen.n_predict, plan.eos_ids, plan.n_ctx, full_lm_head=tree.growth.full_lm_head,
                         stop=request.text, logprobs=request.logprobs, constraint=constraint)
    accept = Accept("accept", stops, params, target.model.logits, tracer, diagnose=target.model.nonfinite_logits,
                    n_ctx_used=n_past,
                    history=list(request.history[-params.repeat_last_n :]) if params.penalizes else [])
    output = Output("output", request.on_tokens)
    ch = plan.channels
    p = Pipeline(tree.policy)
    p.connect(expand, "tree", verify, "tree", ch.tokens)
    if request.batcher is None:  # else the batcher's passes read the layers, once for every request in them
        p.connect(prefetch, "layers", verify, "layers", ch.layers_for(plan.flash.window_layers))
        p.connect(verify, "free", prefetch, "free", plan.flash.window_layers)
    p.connect(verify, "verified", accept, "verified", 1)
    p.connect(accept, "accepted", expand, "accepted", ch.tokens)
    p.connect(accept, "emitted", output, "emitted", 4)
    if request.watch is not None:  # each tree as it goes to verification, then the cycle it made
        p.tap(expand, "tree", request.watch.tree)
        p.tap(accept, "emitted", request.watch.cycle)
    stage = None
    if plan.drafts:  # else no draft model runs: trees grow from the free sources alone, or not at all
        cache = kv.draft if kv is not None and kv.draft is not None else None
        core = _drafter(draft, plan, spec=spec, cache=cache, n_past=n_past, params=params)
        core.constraint, core.constraint_start = constraint, n_past + len(request.ids)
        core.coupled = accept.stream if plan.vocab is None else None  # proposals at Accept's own draws
        stage = Draft("draft", core, compute, tracer)
        p.connect(expand, "expand", stage, "expand", 1)
        p.connect(stage, "expansion", expand, "expansion", 1)
    return Composition(pipeline=p.build(), output=output, verify=verify, accept=accept, expand=expand, draft=stage,
                       tracer=tracer, constraint=constraint)


def _drafter(draft: Model | None, plan: RunPlan, *, spec, cache: KVCache | None, n_past: int,
             params: SamplingParams) -> Drafter:
    """The draft model's core over its cache (a session's, or a new one). Another token table of
    the same tokenizer is mapped (`plan.vocab`; other tokenizers were refused when the plan was
    resolved); the same table is not, and drafting runs as it always did."""
    if draft is None:
        raise LeverError(f"[tree_expand] policy {plan.tree.policy!r} needs a draft model ([model] draft)")
    n_draft, vocab = draft.spec.n_vocab, plan.vocab
    if vocab is None and n_draft != spec.n_vocab:
        raise LeverError(f"[model] draft: vocabulary of {n_draft} tokens, the target has {spec.n_vocab}")
    if vocab is not None and (vocab.n_draft, vocab.n_target) != (n_draft, spec.n_vocab):
        raise LeverError(f"[model] draft: {n_draft:,} and {spec.n_vocab:,} embedding rows for token tables of "
                         f"{vocab.n_draft:,} and {vocab.n_target:,} (draft, target): a row without a token "
                         f"cannot be mapped")
    if plan.tree.top_k > spec.n_vocab:
        raise LeverError(f"[tree_expand] top_k: {plan.tree.top_k} children per node, but the vocabulary has "
                         f"{spec.n_vocab} tokens")
    if cache is None:
        cache = draft.new_cache(plan.n_ctx + plan.tree.draft_rows)
    return Drafter(draft, cache, n_past, sampling=drafting(params, vocab),
                   rng=np.random.default_rng(None if params.seed is None else [params.seed, 1]),
                   batch_layer_fn=plan.placement.draft_batch_fn, vocab=vocab)


def drafting(params: SamplingParams, vocab: VocabMap | None) -> SamplingParams:
    """What the draft ranks and draws its children by: the run's knobs and logit bias, so that it
    proposes what the target will choose (speed only: Accept is exact whatever the draft does).
    The bias over the draft's ids (a token with no counterpart there dropped), a ban as the lowest
    bias (-inf would leave a row with no number to rank); no penalty, the draft is given no text."""
    bias = params.logit_bias
    if not bias:
        return params
    ids, values = bias.ids, np.maximum(bias.values, BIAS.lo)
    if vocab is not None:
        drafts = vocab.to_draft[ids]
        kept = vocab.to_target[drafts] == ids
        ids, values = drafts[kept], values[kept]
    return attrs.evolve(params, logit_bias=LogitBias(tuple(zip(ids.tolist(), values.tolist()))))


def read_only(store: FlashStore, file: GGUFFile, flash: FlashConfig, n_passes: int) -> tuple[Pipeline, Drain]:
    """Prefetch alone over the store, feeding a Drain: n_passes passes of reads, no compute."""
    prefetch = Prefetch("prefetch", store, file, read_spec(file), anyio.CapacityLimiter(flash.queue_depth))
    drain = Drain("drain", n_passes * len(store.streamed), len(store.streamed))
    p = Pipeline("read-only").connect(prefetch, "layers", drain, "layers", 2)
    p.connect(drain, "free", prefetch, "free", flash.window_layers)
    return p.build(), drain


def read_pass_s(model_path, flash: FlashConfig, n_passes: int = 3) -> float:
    """Seconds to read one pass's streamed layers with no compute (`read_only`). Steady state:
    the median time between the ends of consecutive passes, so starting the event loop and the
    reader threads is not counted, which dwarfs a small model's pass."""
    f = GGUFFile(model_path)
    with FlashStore(model_path, flash, file=f) as store:
        if not store.streamed:
            return 0.0
        p, drain = read_only(store, f, flash, max(n_passes, 2))
        run_async(p.run)
        return statistics.median(b - a for a, b in zip(drain.ends, drain.ends[1:]))
