"""A GGUF model held in DRAM: embeddings, the layers, the output head.

The model core every pipeline stage stands on: `Model.embed` turns tokens into rows, the CPU
backend's `layer_forward` runs each layer over any set of tokens with explicit positions and
an explicit mask, and `Model.logits` applies the output projection to only the rows asked
for. A pipeline streaming its target from flash keeps only the embeddings and the head here
(load_layers=False) and hands in the layers it reads.
"""

from __future__ import annotations

import numpy as np

from lever.backends.cpu import native
from lever.backends.cpu.kv_cache import KVCache
from lever.backends.cpu.layer import (
    check_tensors,
    check_vocab,
    held_bytes,
    layer_forward,
    layer_nbytes,
    load_layer,
    resident_layer_bytes,
    tiled_bytes,
    weight_from,
)
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import ModelSpec, read_spec


class Model:
    """A GGUF model held in DRAM. With tiles=True (the default) its weights are read from the
    file, not mapped, and its matrices packed into the tile layout, the form the kernels stream
    fastest (untied embeddings, looked up a row at a time, stay in the row layout); a file
    truncated or replaced afterwards changes nothing. With tiles=False they are views of the
    file's mapping, in the row layout. With load_layers=False only the embeddings and the
    output head are set up: the layers then come from elsewhere (the flash backend)."""

    def __init__(self, path=None, *, file: GGUFFile | None = None, load_layers: bool = True, tiles: bool = True):
        self.file = f = file or GGUFFile(path)
        self.spec = spec = read_spec(f)
        check_tensors(f, spec)
        check_vocab(f, spec)
        self.inv_freq = spec.inv_freq()
        tied = "output.weight" not in f.tensors
        if tiles and not tied:
            info = f.tensor("token_embd.weight")
            self.tok_embd = weight_from(f, info.name, raw=f.read_rows(info.name, 0, info.n_rows))
        else:
            self.tok_embd = weight_from(f, "token_embd.weight", tiles=tiles)
        if self.tok_embd.n_in != spec.n_embd:
            raise LeverError(f"{f.path}: token_embd.weight has {self.tok_embd.n_in} columns, expected {spec.n_embd}")
        self.output_norm = f.floats("output_norm.weight").reshape(-1)
        # Tied embeddings: without output.weight the projection reuses token_embd.
        self.output = self.tok_embd if tied else weight_from(f, "output.weight", tiles=tiles)
        self.layers = [load_layer(f, spec, i, tiles=tiles) for i in range(spec.n_layer)] if load_layers else []

    @property
    def nbytes(self) -> int:
        """The weights this model holds in DRAM, read from its file (tiles=True)."""
        embd = held_bytes(self.tok_embd) if self.tok_embd is not self.output else 0
        return held_bytes(self.output) + embd + 4 * self.output_norm.size + sum(layer_nbytes(lw) for lw in self.layers)

    @staticmethod
    def resident_bytes(f: GGUFFile, spec: ModelSpec) -> int:
        """What Model(file=f) holds (its nbytes), from the header alone: the memory plan's figure."""
        mats = tiled_bytes(f, "output.weight") + f.tensor("token_embd.weight").n_bytes if "output.weight" in f.tensors \
            else tiled_bytes(f, "token_embd.weight")
        return mats + 4 * spec.n_embd + sum(resident_layer_bytes(f, spec, i) for i in range(spec.n_layer))

    def new_cache(self, n_ctx: int) -> KVCache:
        return KVCache(self.spec, n_ctx)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.spec.n_vocab):
            raise LeverError(f"token id out of range [0, {self.spec.n_vocab}): {tokens.min()}..{tokens.max()}")
        return self.tok_embd.dequantize(tokens)

    def forward(self, tokens: np.ndarray, pos: np.ndarray, mask: np.ndarray, cache: KVCache,
                layer_fn=None) -> np.ndarray:
        """Hidden states (n_tok, n_embd) after the last layer; cache gains n_tok pending rows.
        layer_fn: a backend's layer with layer_forward's signature (default: the CPU kernels)."""
        rows = cache.reserve(len(tokens))
        x = self.embed(tokens)
        layer_fn = layer_fn or layer_forward
        for i, lw in enumerate(self.layers):
            x = layer_fn(self.spec, lw, x, pos, mask, cache, i, rows, self.inv_freq)
        return x

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Output projection of the given rows only: (n, n_embd) -> (n, n_vocab)."""
        return self.output(native.rmsnorm(hidden, self.output_norm, self.spec.rms_eps))
