"""A resolved run: everything a configuration decides, decided once, before any weight loads.

`RunPlan.resolve` reads the config against the files' headers (the target's, and the draft's
when the draft model runs) and settles what every later step would otherwise re-derive:

- the pipeline kind, and whether the draft model runs (`drafts`: answered here only, from the
  kind, the tree policy and its sources; lever.tree.config.TreeExpandConfig.drafts);
- the tree config, normalised: policy "none" for a kind that grows no trees;
- the flash config, with the kind's all-resident override applied;
- the target layers kept in DRAM: one `plan_residency` call, which the memory plan, the flash
  store and the cost model all read;
- the cost model, the pruning predictor's settings, the calibrated acceptance table, the
  placement of each stage's work, and the draft's vocabulary map.

Engine.open (lever.pipelines.engine) resolves one per engine; `compose` builds a generation's
graph from the opened models, the plan and a `Request`, and reads no config. Code composing a
pipeline by hand resolves one the same way (README, "Composing a pipeline in code").
"""

from __future__ import annotations

import copy

import attrs
import psutil

from lever.backends.flash import FlashConfig
from lever.backends.flash.config import parse_budget, plan_residency, respread
from lever.backends.flash.layout import layer_extents
from lever.config import PIPELINE_KINDS, ChannelsConfig, Config, GenerateConfig, PipelineKind, RuntimeConfig
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import ModelSpec, read_spec
from lever.gguf.tokenizer import Tokenizer
from lever.gguf.vocab_map import VocabMap, pair_vocabularies
from lever.model.grammar import Grammar
from lever.model.grammar_cache import one_grammar_bytes, plan_bytes
from lever.model.transformer import HEAD_ROWS
from lever.policy.acceptance import AcceptanceTable
from lever.policy.cost_model import CostModel, cost_model_for, layer_read_bytes
from lever.policy.memory import (
    MemoryConfig,
    MemoryPlan,
    auto_limit_bytes,
    fill_residency,
    plan_memory,
    runtime_bytes_for,
)
from lever.policy.placement import Placement, placement_for
from lever.policy.predictor import Artifact, Pruning, artifact_path, pruning_for
from lever.tree.config import TreeExpandConfig


@attrs.frozen
class DraftPlan:
    """The draft model as a plan holds it: its header, and its token table mapped to the
    target's (None: the same table)."""

    file: GGUFFile
    spec: ModelSpec
    vocab: VocabMap | None = None


@attrs.frozen
class PlanSizes:
    """What the memory plan adds beside the files' figures."""

    runtime_bytes: int = 0  # an accelerator runtime's own DRAM
    grammar_bytes: int = 0  # structured output's part (lever.model.grammar_cache); 0: none runs
    fill: MemoryPlan | None = None  # [flash] dram_budget = "fill": the plan the resident layers were placed by
    parallel: int = 1  # generations at once ([pipeline] parallel), each with caches of n_ctx rows


@attrs.frozen(eq=False, kw_only=True)
class RunPlan:
    """A config resolved against its files' headers: what every generation of one engine shares."""

    where: str  # how errors name the config
    kind: PipelineKind
    tree: TreeExpandConfig  # normalised: policy "none" when the kind grows no trees; one tree's caps (per_tree)
    flash: FlashConfig  # the kind's all-resident override applied
    resident: frozenset[int]  # target layers kept in DRAM: the memory plan's, the store's, the cost model's
    n_ctx: int  # KV rows: [model] n_ctx, capped by the target's trained context
    generate: GenerateConfig  # a request's defaults ([generate])
    channels: ChannelsConfig
    runtime: RuntimeConfig
    memory: MemoryConfig
    target_file: GGUFFile
    spec: ModelSpec
    tok: Tokenizer  # the target's, which the pair shares
    draft: DraftPlan | None = None  # the draft model, when it runs
    cost: CostModel | None = None  # trees' prices; None for a kind that grows none
    pruning: Pruning | None = None  # the predictor's resolved settings ([predictor] enabled)
    acceptance: AcceptanceTable | None = None  # `lever calibrate`'s table ([tree_expand] acceptance = "calibrated")
    placement: Placement = attrs.field(factory=Placement)
    sizes: PlanSizes = attrs.field(factory=PlanSizes)
    warnings: tuple[str, ...] = ()  # one line each, for the caller to print

    @property
    def draft_file(self) -> GGUFFile | None:
        return self.draft.file if self.draft is not None else None

    @property
    def draft_spec(self) -> ModelSpec | None:
        return self.draft.spec if self.draft is not None else None

    @property
    def vocab(self) -> VocabMap | None:
        """The draft's token table mapped to the target's; None: the same table (or no draft)."""
        return self.draft.vocab if self.draft is not None else None

    @property
    def parallel(self) -> int:
        return self.sizes.parallel

    @property
    def fill(self) -> MemoryPlan | None:
        return self.sizes.fill

    def memory_plan(self, n_prompt: int, process_bytes: int | None = None,
                    resident: frozenset[int] | None = None) -> MemoryPlan:
        """This run's memory plan for a prompt of n_prompt tokens (run_memory), with its own
        resident layers or `resident`."""
        return run_memory(target=self.target_file, spec=self.spec, flash=self.flash, tree=self.tree, n_ctx=self.n_ctx,
                          parallel=self.parallel, draft_file=self.draft_file, draft_spec=self.draft_spec,
                          runtime_bytes=self.sizes.runtime_bytes, n_prompt=n_prompt,
                          resident=self.resident if resident is None else resident,
                          process_bytes=process_bytes, grammar_bytes=self.sizes.grammar_bytes)

    def refill(self, limit_bytes: int, held: frozenset[int], process_bytes: int) -> tuple[frozenset[int], MemoryPlan]:
        """A live memory budget's plan (Engine.set_memory): the most resident layers a run
        within `limit_bytes` holds, placed as --mem's fill places them (a prompt filling the
        context; the process as it was before loading), the layers kept a subset of those
        `held` or a superset (respread), and one layer's buffer more: what a pass planned before
        a drop reads for itself. Refuses, naming the limit and the floor, what every layer streamed
        does not fit."""
        late = max(e.buffer_bytes for e in layer_extents(self.target_file))
        try:
            return fill_residency(limit_bytes - late, self.spec.n_layer,
                                  lambda r: self.memory_plan(self.n_ctx - 1, process_bytes, resident=r),
                                  choose=lambda k: respread(self.spec.n_layer, held, k))
        except LeverError as e:
            floor = self.live_bounds(process_bytes)[0]
            raise LeverError(f"memory: a cap of {limit_bytes >> 20} MiB is below this run's floor of {floor >> 20} "
                             f"MiB (every layer streamed): {str(e).split(': ', 2)[-1]}") from None

    def live_bounds(self, process_bytes: int) -> tuple[int, int]:
        """The least limit `refill` takes (every layer streamed) and the least that holds every
        layer resident, in bytes."""
        late = max(e.buffer_bytes for e in layer_extents(self.target_file))
        every = frozenset(range(self.spec.n_layer))
        return tuple(self.memory_plan(self.n_ctx - 1, process_bytes, resident=r).total_bytes + late
                     for r in (frozenset(), every))

    def with_resident(self, resident: frozenset[int], limit_bytes: int) -> RunPlan:
        """This plan with other resident layers, held within `limit_bytes` ([memory] limit),
        its trees priced by the reads those leave."""
        cost = self.cost
        if cost is not None:
            cost = attrs.evolve(cost, layer_read_bytes=layer_read_bytes(self.target_file, self.flash, resident))
        return attrs.evolve(self, resident=resident, cost=cost, memory=attrs.evolve(self.memory, limit=limit_bytes))

    @property
    def drafts(self) -> bool:
        """Whether the draft model runs (TreeExpandConfig.drafts of the normalised tree)."""
        return self.tree.drafts

    @property
    def pipeline(self) -> str:
        """The run's name in results: the kind, and the tree policy of a kind that grows trees."""
        return f"{self.kind.name}/{self.tree.policy}" if self.kind.speculates else self.kind.name

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.tok.eos_ids)

    def new_acceptance(self) -> AcceptanceTable | None:
        """A run's own copy of the calibrated table, which it learns on."""
        return copy.deepcopy(self.acceptance)

    @classmethod
    def resolve(cls, cfg: Config, kind: str | None = None, *, target: GGUFFile | None = None,
                tok: Tokenizer | None = None, grammars: bool | Grammar = False) -> RunPlan:
        """The plan of `kind` (default [pipeline] kind) under `cfg`; `target` and `tok` when the
        caller has them open already (else read from [model] target); `grammars`: structured
        output may run (a grammar cache's bytes in the memory plan: grammar_cache.plan_bytes), or
        this one grammar will (its bytes and one generation's: grammar_cache.one_grammar_bytes)."""
        pk = PIPELINE_KINDS[kind or cfg.pipeline.kind]
        if not cfg.model.target:
            raise LeverError(f"{cfg.where}: [model] target: no target model given")
        f = target if target is not None else GGUFFile(cfg.model.target)
        spec = read_spec(f)
        tok = tok if tok is not None else Tokenizer.from_gguf(f)
        tree = cfg.tree_expand.per_tree(cfg.pipeline.parallel) if pk.speculates else TreeExpandConfig(policy="none")
        flash = attrs.evolve(cfg.flash, dram_budget=1.0) if pk.all_resident else cfg.flash
        n_ctx = min(cfg.model.n_ctx, spec.n_ctx_train)
        draft_file = draft_spec = vocab = None
        warnings: list[str] = []
        if tree.drafts:  # sources without "model" need no draft model (lever.policy.lookup)
            if not cfg.model.draft:
                raise LeverError(f"{cfg.where}: [model] draft: a speculative pipeline needs a draft model "
                                 "(or [tree_expand] sources without \"model\")")
            draft_file = GGUFFile(cfg.model.draft)
            draft_spec = read_spec(draft_file)
            # another tokenizer is refused, another table of the same one mapped, once, here;
            # special ids that differ are warned (lever.gguf.vocab_map)
            vocab, warnings = pair_vocabularies(f, draft_file)
        fill = None
        grammar_bytes = one_grammar_bytes(grammars, spec.n_vocab) if isinstance(grammars, Grammar) else \
            plan_bytes(spec.n_vocab) if grammars else 0
        if parse_budget(flash.dram_budget).kind == "fill":
            resident, fill = _fill(cfg, f, spec, flash=flash, tree=tree, n_ctx=n_ctx, parallel=cfg.pipeline.parallel,
                                   draft_file=draft_file,
                                   draft_spec=draft_spec, grammar_bytes=grammar_bytes)
        else:
            resident = plan_residency([e.buffer_bytes for e in layer_extents(f)], flash.dram_budget)
        cost = pruning = acceptance = None
        if pk.speculates:
            cost = cost_model_for(target=cfg.model.target, draft=cfg.model.draft or None, flash=flash,
                                  resident=resident, profile=cfg.profile,
                                  emulate_layer_ms_per_token=cfg.runtime.emulate_layer_ms_per_token,
                                  what_if_read_bytes_per_s=cfg.runtime.what_if_read_bytes_per_s, target_file=f)
            pruning, acceptance = _calibrated(cfg, spec)
        placement = placement_for(cfg.placement, cfg.qnn, flash_mode=cfg.flash.mode, target_spec=spec,
                                  draft_spec=draft_spec, n_ctx=n_ctx)
        draft = DraftPlan(draft_file, draft_spec, vocab) if draft_file is not None else None
        return cls(where=cfg.where, kind=pk, tree=tree, flash=flash, resident=resident, n_ctx=n_ctx,
                   generate=cfg.generate, channels=cfg.channels, runtime=cfg.runtime, memory=cfg.memory,
                   target_file=f, spec=spec, tok=tok, draft=draft, cost=cost, pruning=pruning, acceptance=acceptance,
                   placement=placement, warnings=tuple(warnings),
                   sizes=PlanSizes(runtime_bytes_for(cfg.placement), grammar_bytes, fill, cfg.pipeline.parallel))


def run_memory(*, target: GGUFFile, spec: ModelSpec, flash: FlashConfig, tree: TreeExpandConfig, n_ctx: int,
               parallel: int = 1, draft_file: GGUFFile | None, draft_spec: ModelSpec | None, runtime_bytes: int,
               n_prompt: int,
               resident: frozenset[int], process_bytes: int | None = None, grammar_bytes: int = 0) -> MemoryPlan:
    """A run's memory plan (lever.policy.memory.plan_memory) for a prompt of n_prompt tokens:
    the one wiring of its parts, for Engine's check and for fill's placement alike."""
    return plan_memory(target, spec, flash, n_ctx=n_ctx, parallel=parallel, n_pass_tokens=max(n_prompt, tree.max_nodes),
                       tree_rows=tree.max_nodes, draft=draft_file, draft_spec=draft_spec,
                       # Accept runs the output head along the accepted path only (root and max_depth)
                       head_rows=tree.max_nodes if tree.growth.full_lm_head else min(tree.max_depth + 1, HEAD_ROWS),
                       draft_rows=tree.draft_rows if tree.drafts else 0, runtime_bytes=runtime_bytes,
                       resident=resident, process_bytes=process_bytes, grammar_bytes=grammar_bytes)


def _fill(cfg: Config, f: GGUFFile, spec: ModelSpec, *, flash: FlashConfig, tree: TreeExpandConfig, n_ctx: int,
          parallel: int, draft_file: GGUFFile | None, draft_spec: ModelSpec | None,
          grammar_bytes: int = 0) -> tuple[frozenset[int], MemoryPlan]:
    """[flash] dram_budget = "fill": the layers [memory] limit holds beside everything else
    the run plans (run_memory's parts, for a prompt filling the context: what a server checks
    its calls against, and cheap to reserve now that a long pass runs a layer in chunks)."""
    limit, auto = cfg.memory.limit_bytes, ""
    if limit is None:  # "auto": a share of what the machine (or its cgroup) has available now
        limit = auto_limit_bytes()
        auto = " (\"auto\": a share of the memory available now; give one with --mem or [memory] limit)"
    process_bytes = psutil.Process().memory_info().rss  # once: every candidate is priced against the same process

    def plan(resident: frozenset[int]) -> MemoryPlan:
        return run_memory(target=f, spec=spec, flash=flash, tree=tree, n_ctx=n_ctx, parallel=parallel,
                          draft_file=draft_file,
                          draft_spec=draft_spec, runtime_bytes=runtime_bytes_for(cfg.placement),
                          n_prompt=n_ctx - 1, resident=resident, process_bytes=process_bytes,
                          grammar_bytes=grammar_bytes)

    try:
        return fill_residency(limit, spec.n_layer, plan)
    except LeverError as e:
        raise LeverError(f"{cfg.where}: {str(e).replace('[memory] limit', '[memory] limit' + auto, 1)}") from None


def _calibrated(cfg: Config, spec: ModelSpec) -> tuple[Pruning | None, AcceptanceTable | None]:
    """The pruning predictor's settings ([predictor] enabled) and TreeExpand's starting table
    ([tree_expand] acceptance = "calibrated"), from `lever calibrate`'s artifact, read once."""
    pc, want_table = cfg.predictor, cfg.tree_expand.acceptance == "calibrated"
    if not pc.enabled and not want_table:
        return None, None
    path = cfg.model.target
    art = None
    if want_table or pc.layer < 0 or pc.threshold < 0:
        art = Artifact.read(artifact_path(pc.artifact, path), path)
    return (pruning_for(pc, spec.n_layer, art) if pc.enabled else None), (art.acceptance if want_table else None)


def cost_model(cfg: Config, target_file: GGUFFile | None = None) -> CostModel:
    """The cost model a run of `cfg` prices trees with, made alone for a command outside a run
    (`lever calibrate` prices pruning with it); a run's own is its RunPlan's."""
    if not cfg.model.target:
        raise LeverError(f"{cfg.where}: [model] target is not set")
    return cost_model_for(target=cfg.model.target, draft=cfg.model.draft or None, flash=cfg.flash, profile=cfg.profile,
                          emulate_layer_ms_per_token=cfg.runtime.emulate_layer_ms_per_token,
                          what_if_read_bytes_per_s=cfg.runtime.what_if_read_bytes_per_s, target_file=target_file)
