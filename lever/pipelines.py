"""Compositions of stages: the pipelines a config can name, built in a few lines each.

`FlashTarget.open` sets up the target model on the flash backend (resident layers read once,
the rest streamed). `compose` joins TreeExpand, Draft, Prefetch, PrunedVerify, Accept and Output:
with TreeExpand's policy "none" and no Draft it is Flash-AR, the paper's baseline (memory-resident
AR is the same with a 100% DRAM budget); with a draft model and a tree policy it is speculative
decoding: chain (Chain-SD), kary, or gain-cost (Lever). A custom pipeline is the same few
`connect` calls (see examples/custom_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import attrs
import numpy as np

from lever import native
from lever.backends.flash import FlashConfig, FlashStore
from lever.calibration import Calibration
from lever.compute import ComputeSlot
from lever.config import Config
from lever.errors import LeverError
from lever.gguf_file import GGUFFile
from lever.graph import Pipeline
from lever.kv_cache import KVCache
from lever.model import LayerWeights, Model, layer_forward, layer_nbytes, load_layer, tiled_weight
from lever.placement import Placement
from lever.predictor import Predictor
from lever.sampling import SamplingParams
from lever.stages.accept import Accept, AcceptConfig
from lever.stages.draft import Draft, DraftModel
from lever.stages.output import Output
from lever.stages.prefetch import Prefetch
from lever.stages.pruned_verify import PrunedVerify
from lever.stages.tree_expand import Cost, FlatCost, TreeExpand, TreeExpandConfig
from lever.trace import Tracer


@attrs.define
class FlashTarget:
    """The target model with its layers on the flash backend."""

    model: Model  # embeddings and output head (resident); no layers
    store: FlashStore
    resident: dict[int, LayerWeights]

    @classmethod
    def open(cls, path, flash: FlashConfig, file: GGUFFile | None = None) -> FlashTarget:
        f = file or GGUFFile(path)
        model = Model(file=f, load_layers=False, tiles=False)
        store = FlashStore(path, flash, file=f)
        try:
            # Resident layers are read once through the store and packed into the tile layout
            # (the kernels' fastest form); their read buffer goes back once packed.
            resident = {}
            for i in sorted(store.resident):
                resident[i] = load_layer(f, model.spec, i, raws=store.resident_layer(i), tiles=True)
                store.drop_resident(i)
            # The head is resident and read whole every cycle: a copy costs no more DRAM than
            # its mapping, and a mapped page of a file truncated under the run would kill the
            # process (SIGBUS) where a read through the store is an error naming the file.
            tied = model.output is model.tok_embd
            name = "token_embd.weight" if tied else "output.weight"
            head = model.output
            model.output = tiled_weight(head.type_id, head.n_out, head.n_in,
                                        lambda r0, r1: store.tensor_span(name, r0, r1))
            if tied:
                model.tok_embd = model.output
        except BaseException:
            store.close()
            raise
        return cls(model, store, resident)

    @property
    def resident_bytes(self) -> int:
        return sum(layer_nbytes(lw) for lw in self.resident.values())

    @property
    def head_bytes(self) -> int:
        """The output projection, kept resident: Accept runs it on the CPU every cycle."""
        return self.model.output.nbytes

    @property
    def window_bytes(self) -> int:
        pool = self.store.pool
        return pool.n_buffers * pool.buffer_bytes if pool and self.store.streamed else 0

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Model.embed, with untied embeddings read row by row through the store rather than
        from the mapping (see `open`)."""
        m = self.model
        if m.tok_embd is m.output:
            return m.embed(tokens)
        tokens = np.asarray(tokens, np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= m.spec.n_vocab):
            raise LeverError(f"token id out of range [0, {m.spec.n_vocab}): {tokens.min()}..{tokens.max()}")
        rows = self.store.tensor_rows("token_embd.weight", tokens)
        return native.dequantize(m.tok_embd.type_id, rows, tokens.size, m.tok_embd.n_in)

    def warm_head(self) -> None:
        """Touch the output head once so the first pass does not count its read as streaming."""
        self.model.output.data.sum()

    def close(self) -> None:
        self.store.close()


@attrs.define
class Handles:
    """What a caller reads after a run."""

    pipeline: Pipeline
    output: Output
    verify: PrunedVerify
    accept: Accept
    expand: TreeExpand
    draft: Draft | None
    tracer: Tracer


def compose(target: FlashTarget, prompt: list[int], cfg: Config, params: SamplingParams, eos_ids: frozenset[int],
            n_ctx: int, tracer: Tracer, on_tokens: Callable[[tuple[int, ...]], None] | None = None,
            draft_model: Model | None = None, tree: TreeExpandConfig | None = None, cost: Cost | None = None,
            predictor: Predictor | None = None, calibration: Calibration | None = None, observer=None,
            placement: Placement | None = None) -> Handles:
    spec = target.model.spec
    tree = tree or TreeExpandConfig(policy="none")
    compute = ComputeSlot(cfg.runtime.ahead_cores)  # verification first; drafting ahead beside it or in turns
    expand = TreeExpand("tree_expand", tree, prompt, cost or FlatCost(), n_ctx, tracer,
                        calibration=calibration, ahead_beside=bool(compute.ahead_cores))
    prefetch = Prefetch("prefetch", target.store, target.model.file, spec,
                        anyio.CapacityLimiter(cfg.flash.queue_depth), tracer)
    verify = PrunedVerify("verify", spec, target.embed, KVCache(spec, n_ctx + tree.max_nodes), target.resident,
                          compute, predictor, tracer, observer, cfg.runtime.emulate_layer_ms_per_token / 1e3,
                          placement.verify_fn if placement is not None else layer_forward)
    accept = Accept("accept", AcceptConfig(cfg.generate.n_predict, eos_ids, n_ctx, full_lm_head=tree.policy == "confidence"),
                    params, target.model.logits, tracer)
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
    if tree.policy != "none":
        if draft_model is None:
            raise LeverError(f"[tree_expand] policy {tree.policy!r} needs a draft model ([model] draft)")
        if draft_model.spec.n_vocab != spec.n_vocab:
            raise LeverError(f"[model] draft: vocabulary of {draft_model.spec.n_vocab} tokens, the target has {spec.n_vocab}")
        if tree.top_k > spec.n_vocab:
            raise LeverError(f"[tree_expand] top_k: {tree.top_k} children per node, but the vocabulary has {spec.n_vocab} tokens")
        core = DraftModel(draft_model, draft_model.new_cache(n_ctx + tree.draft_rows), sampling=params,
                          rng=np.random.default_rng(None if params.seed is None else [params.seed, 1]),
                          batch_layer_fn=placement.draft_batch_fn if placement is not None else None)
        draft = Draft("draft", core, compute, tracer)
        p.connect(expand, "expand", draft, "expand", 1)
        p.connect(draft, "expansion", expand, "expansion", 1)
    return Handles(p.build(), output, verify, accept, expand, draft, tracer)


def flash_ar(target: FlashTarget, prompt: list[int], cfg: Config, params: SamplingParams, eos_ids: frozenset[int],
             n_ctx: int, tracer: Tracer, on_tokens: Callable[[tuple[int, ...]], None] | None = None) -> Handles:
    return compose(target, prompt, cfg, params, eos_ids, n_ctx, tracer, on_tokens)
