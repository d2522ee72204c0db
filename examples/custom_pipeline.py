"""Composing a pipeline in code: Flash-AR built from its stages by hand, with a custom sink.

Run: python examples/custom_pipeline.py MODEL.gguf "prompt"   (defaults to stories260K)
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import attrs

from lever.backends.cpu.kv_cache import KVCache
from lever.backends.flash import FlashConfig
from lever.dataflow.graph import Pipeline, Stage
from lever.dataflow.messages import Accepted
from lever.gguf.tokenizer import StreamDecoder, Tokenizer
from lever.model.sampling import SamplingParams
from lever.pipelines.target import FlashTarget
from lever.stages.accept import Accept, AcceptConfig
from lever.stages.prefetch import Prefetch
from lever.stages.pruned_verify import PrunedVerify
from lever.stages.tree_expand import TreeExpand
from lever.tree.config import TreeExpandConfig
from lever.tree.cycle import TreeCycle


@attrs.define
class Printer(Stage):
    """A sink of our own: prints each cycle's tokens as they come."""

    name: str
    text: StreamDecoder  # holds back bytes of a character split across tokens
    INPUTS = {"emitted": Accepted}
    tokens: list[int] = attrs.field(factory=list)

    async def run(self, inputs, outputs):
        async for acc in inputs["emitted"]:
            self.tokens.extend(acc.tokens)
            print("".join(self.text.push(t) for t in acc.tokens), end="", flush=True)


def main(model_path: str, prompt: str, n: int = 32) -> list[int]:
    target = FlashTarget.open(model_path, FlashConfig(mode="mmap", dram_budget=0.5))
    tok = Tokenizer.from_gguf(target.model.file)
    spec = target.model.spec
    expand = TreeExpand("expand", TreeCycle.for_run(TreeExpandConfig(policy="none"), tok.encode(prompt)))  # Flash-AR
    prefetch = Prefetch("prefetch", target.store, target.model.file, spec, anyio.CapacityLimiter(4))
    verify = PrunedVerify("verify", spec, target.embed, KVCache(spec, 512), target.resident)
    accept = Accept("accept", AcceptConfig(n_predict=n), SamplingParams(), target.model.logits)
    printer = Printer("printer", StreamDecoder(tok, at_start=False))
    p = (Pipeline("my-flash-ar")
         .connect(expand, "tree", verify, "tree")
         .connect(prefetch, "layers", verify, "layers", capacity=2)
         .connect(verify, "free", prefetch, "free", capacity=target.store.pool.n_buffers)
         .connect(verify, "verified", accept, "verified")
         .connect(accept, "accepted", expand, "accepted")
         .connect(accept, "emitted", printer, "emitted"))
    try:
        anyio.run(p.run)
    finally:
        target.close()
    print(printer.text.flush())
    return printer.tokens


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K.gguf"
    main(sys.argv[1] if len(sys.argv) > 1 else str(default), sys.argv[2] if len(sys.argv) > 2 else "Once upon a time")
