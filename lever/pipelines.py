"""Compositions of stages: the pipelines a config can name, built in a few lines each.

`open_target` sets up the target model on the flash backend (resident layers read once, the
rest streamed); `flash_ar` joins Draft (proposing nothing), Prefetch, PrunedVerify, Accept and
Output into Flash-AR, the paper's baseline. Memory-resident AR is the same pipeline with a 100%
DRAM budget. A custom pipeline is the same few `connect` calls (see examples/custom_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import attrs

from lever.backends.flash import FlashConfig, FlashStore
from lever.config import Config
from lever.gguf_file import GGUFFile
from lever.graph import Pipeline
from lever.kv_cache import KVCache
from lever.model import LayerWeights, Model, load_layer
from lever.sampling import SamplingParams
from lever.stages.accept import Accept, AcceptConfig
from lever.stages.draft import Draft
from lever.stages.output import Output
from lever.stages.prefetch import Prefetch
from lever.stages.pruned_verify import PrunedVerify
from lever.trace import Tracer


@attrs.define
class FlashTarget:
    """The target model with its layers on the flash backend."""

    model: Model  # embeddings and output head (resident); no layers
    store: FlashStore
    resident: dict[int, LayerWeights]

    @classmethod
    def open(cls, path, flash: FlashConfig) -> FlashTarget:
        f = GGUFFile(path)
        model = Model(file=f, load_layers=False)
        store = FlashStore(path, flash, file=f)
        try:
            resident = {i: load_layer(f, model.spec, i, raws=store.resident_layer(i)) for i in sorted(store.resident)}
        except BaseException:
            store.close()
            raise
        return cls(model, store, resident)

    @property
    def resident_bytes(self) -> int:
        return sum(self.store.layer_bytes[i] for i in self.resident)

    @property
    def head_bytes(self) -> int:
        """The output projection, kept resident: Accept runs it on the CPU every cycle."""
        return self.model.output.nbytes

    @property
    def window_bytes(self) -> int:
        pool = self.store.pool
        return pool.n_buffers * pool.buffer_bytes if pool and self.store.streamed else 0

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
    tracer: Tracer


def flash_ar(target: FlashTarget, prompt: list[int], cfg: Config, params: SamplingParams, eos_ids: frozenset[int],
             n_ctx: int, tracer: Tracer, on_tokens: Callable[[tuple[int, ...]], None] | None = None) -> Handles:
    spec = target.model.spec
    compute = anyio.CapacityLimiter(1)  # the kernels use every core; one compute job at a time
    draft = Draft("draft", prompt, tracer=tracer)
    prefetch = Prefetch("prefetch", target.store, target.model.file, spec,
                        anyio.CapacityLimiter(cfg.flash.queue_depth), tracer)
    verify = PrunedVerify("verify", spec, target.model.embed, KVCache(spec, n_ctx), target.resident, compute, tracer)
    accept = Accept("accept", AcceptConfig(cfg.generate.n_predict, eos_ids, n_ctx), params, target.model.logits, tracer)
    output = Output("output", on_tokens)
    ch = cfg.channels
    p = Pipeline("flash-ar")
    p.connect(draft, "tree", verify, "tree", ch.tokens)
    p.connect(prefetch, "layers", verify, "layers", ch.layers)
    p.connect(verify, "free", prefetch, "free", cfg.flash.window_layers)
    p.connect(verify, "verified", accept, "verified", 1)
    p.connect(accept, "accepted", draft, "accepted", ch.tokens)
    p.connect(accept, "emitted", output, "emitted", 4)
    return Handles(p.build(), output, verify, accept, tracer)
