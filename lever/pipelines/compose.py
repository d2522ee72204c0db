"""Compositions of stages: the pipelines a config can name, built in a few lines each.

`compose` joins TreeExpand, Draft, Prefetch, PrunedVerify, Accept and Output:
with TreeExpand's policy "none" and no Draft it is Flash-AR, the paper's baseline (memory-resident
AR is the same with a 100% DRAM budget); with a draft model and a tree policy it is speculative
decoding: chain (Chain-SD), kary, or gain-cost (Lever). A custom pipeline is the same few
`connect` calls (see examples/custom_pipeline.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import anyio
import attrs
import numpy as np

from lever.backends.cpu.kv_cache import KVCache
from lever.backends.cpu.layer import layer_forward
from lever.backends.flash import FlashConfig, FlashStore
from lever.config import Config
from lever.dataflow.compute import ComputeSlot
from lever.dataflow.graph import Pipeline
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import read_spec
from lever.gguf.vocab_map import VocabMap
from lever.model.sampling import SamplingParams
from lever.model.transformer import Model
from lever.pipelines.target import FlashTarget
from lever.policy.acceptance import AcceptanceTable
from lever.policy.placement import Placement
from lever.policy.predictor import Predictor
from lever.signals import run_async
from lever.stages.accept import Accept, AcceptConfig, StopRule
from lever.stages.draft import Draft, Drafter
from lever.stages.output import Output
from lever.stages.prefetch import Prefetch
from lever.stages.pruned_verify import PrunedVerify
from lever.stages.testing import Drain
from lever.stages.tree_expand import Cost, FlatCost, TreeExpand, TreeExpandConfig


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

    def kv_after(self) -> KVState:
        """The caches after the run, cut to the rows both hold as text: the target's before its
        last pass, the draft's committed ones (the last cycle's are still pending in both)."""
        n = self.verify.n_committed
        if self.draft is not None:
            n = min(n, self.draft.core.n_committed)
        kv = KVState(self.verify.cache, self.draft.core.cache if self.draft is not None else None, n)
        kv.truncate(n)
        return kv


def compose(target: FlashTarget, prompt: list[int], *, cfg: Config, params: SamplingParams, eos_ids: frozenset[int],
            n_ctx: int, tracer: Tracer, on_tokens: Callable[[tuple[int, ...]], None] | None = None,
            draft_model: Model | None = None, vocab: VocabMap | None = None, tree: TreeExpandConfig | None = None,
            cost: Cost | None = None, predictor: Predictor | None = None, acceptance: AcceptanceTable | None = None,
            observer=None, placement: Placement | None = None, stop: StopRule | None = None,
            kv: KVState | None = None, history: Sequence[int] = ()) -> Composition:
    """The pipeline over `prompt`; with `kv`, `prompt` continues the text those caches hold
    (`kv.n_rows` tokens) and only it is prefilled. `vocab` maps a draft's token table to the
    target's where they differ (lever.gguf.vocab_map.pair_vocabularies: Engine.open makes it once
    per pair); None: the draft's table is the target's."""
    spec = target.model.spec
    n_past = kv.n_rows if kv is not None else 0
    tree = tree or TreeExpandConfig(policy="none")
    if tree.adapt and not params.greedy and params.seed is not None:
        # the trees would follow the machine's timing, and the draws with them: a seed must
        # give the same text every time, so a seeded sampled run prices trees by the profile
        tree = attrs.evolve(tree, adapt=False)
    compute = ComputeSlot(cfg.runtime.ahead_cores)  # verification first; drafting ahead beside it or in turns
    expand = TreeExpand("tree_expand", tree, prompt, cost or FlatCost(), n_ctx, tracer, cfg.generate.n_predict,
                        acceptance=acceptance, ahead_beside=bool(compute.ahead_cores), committed=n_past,
                        greedy=params.greedy)
    prefetch = Prefetch("prefetch", target.store, target.model.file, spec,
                        anyio.CapacityLimiter(cfg.flash.queue_depth), tracer)
    verify = PrunedVerify("verify", spec, target.embed, kv.target if kv is not None else KVCache(spec, n_ctx + tree.max_nodes),
                          target.resident,
                          compute, predictor, tracer, observer, cfg.runtime.emulate_layer_ms_per_token / 1e3,
                          placement.verify_fn if placement is not None else layer_forward)
    accept = Accept("accept", AcceptConfig(cfg.generate.n_predict, eos_ids, n_ctx, full_lm_head=tree.growth.full_lm_head,
                                           stop=stop),
                    params, target.model.logits, tracer, diagnose=target.model.nonfinite_logits, n_ctx_used=n_past,
                    history=list(history[-params.repeat_last_n :]) if params.penalizes else [])
    output = Output("output", on_tokens)
    ch = cfg.channels
    p = Pipeline(tree.policy)
    p.connect(expand, "tree", verify, "tree", ch.tokens)
    p.connect(prefetch, "layers", verify, "layers", ch.layers)
    p.connect(verify, "free", prefetch, "free", cfg.flash.window_layers)
    p.connect(verify, "verified", accept, "verified", 1)
    p.connect(accept, "accepted", expand, "accepted", ch.tokens)
    p.connect(accept, "emitted", output, "emitted", 4)
    draft = None
    if tree.drafts:  # else no draft model runs: trees grow from the free sources alone, or not at all
        if draft_model is None:
            raise LeverError(f"[tree_expand] policy {tree.policy!r} needs a draft model ([model] draft)")
        # another token table of the same tokenizer is mapped (`vocab`, made at Engine.open; other
        # tokenizers were refused there); the same table is not, and drafting runs as it always did
        n_draft = draft_model.spec.n_vocab
        if vocab is None and n_draft != spec.n_vocab:
            raise LeverError(f"[model] draft: vocabulary of {n_draft} tokens, the target has {spec.n_vocab}")
        if vocab is not None and (vocab.n_draft, vocab.n_target) != (n_draft, spec.n_vocab):
            raise LeverError(f"[model] draft: {n_draft:,} and {spec.n_vocab:,} embedding rows for token tables of "
                             f"{vocab.n_draft:,} and {vocab.n_target:,} (draft, target): a row without a token "
                             f"cannot be mapped")
        if tree.top_k > spec.n_vocab:
            raise LeverError(f"[tree_expand] top_k: {tree.top_k} children per node, but the vocabulary has {spec.n_vocab} tokens")
        cache = kv.draft if kv is not None and kv.draft is not None else draft_model.new_cache(n_ctx + tree.draft_rows)
        core = Drafter(draft_model, cache, n_past, sampling=params,
                          rng=np.random.default_rng(None if params.seed is None else [params.seed, 1]),
                          batch_layer_fn=placement.draft_batch_fn if placement is not None else None, vocab=vocab)
        draft = Draft("draft", core, compute, tracer)
        p.connect(expand, "expand", draft, "expand", 1)
        p.connect(draft, "expansion", expand, "expansion", 1)
    return Composition(p.build(), output, verify, accept, expand, draft, tracer)


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
