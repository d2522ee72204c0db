"""A GGUF model held in DRAM: embeddings, the layers, the output head.

The model core every pipeline stage stands on: `Model.embed` turns tokens into rows, the CPU
backend's `layer_forward` runs each layer over any set of tokens with explicit positions and
an explicit mask, and `Model.logits` applies the output projection to only the rows asked
for. A pipeline streaming its target from flash keeps only the embeddings and the head here
(load_layers=False) and hands in the layers it reads. A NaN or an Inf is caught where it is
cheap to: the small float tensors at load, the hidden state at the end of a forward (one max),
the logits by whoever reads them (`check_logits`); the diagnosis runs only after (lever.model.finite).
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
    layer_in_chunks,
    layer_nbytes,
    layer_tensor_names,
    load_layer,
    resident_layer_bytes,
    tiled_bytes,
    weight_from,
)
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.gguf.spec import ModelSpec, read_spec
from lever.model.finite import (
    HINT,
    NonFiniteError,
    check_small_tensors,
    counts,
    finite,
    first_bad_row,
    first_bad_tensor,
    said,
)

# rows of vocabulary logits the output head gives at once where rows come one after another
# (Accept's batches along the likely path): a batch reads the projection once for its rows,
# and 16 rows of a 152k vocabulary are 9.7 MB, where a path of 65 held 40 MB per request
HEAD_ROWS = 16


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
        check_small_tensors(f)  # every layer's, streamed or not: a NaN norm weight passes every other check
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
            x = layer_in_chunks(layer_fn, self.spec, lw, x, pos=pos, mask=mask, cache=cache, layer=i, rows=rows,
                                inv_freq=self.inv_freq)
        if not finite(x):  # one max over (n_tok, n_embd); what went wrong where is found only now
            raise self._nonfinite_forward(tokens, pos, mask, cache, rows, layer_fn)
        return x

    def _nonfinite_forward(self, tokens, pos, mask, cache, rows, layer_fn) -> NonFiniteError:
        """The forward again, checked after the embedding and after every layer: the first whose
        output holds a NaN or an Inf, at the first position where it does, and the tensor of that
        layer that holds any. The cache rows are the same ones, rewritten with the same values."""
        x = self.embed(tokens)
        bad = first_bad_row(x)
        if bad is not None:
            cause = first_bad_tensor(self.file, ["token_embd.weight"]) or "the embedding"
            return NonFiniteError("hidden state", path=self.file.path, position=int(pos[bad]),
                                  layer=f"first in the embedding of token {int(tokens[bad])}", cause=f"{cause}; {HINT}")
        for i, lw in enumerate(self.layers):
            x = layer_in_chunks(layer_fn, self.spec, lw, x, pos=pos, mask=mask, cache=cache, layer=i, rows=rows,
                                inv_freq=self.inv_freq)
            bad = first_bad_row(x)
            if bad is not None:
                cause = first_bad_tensor(self.file, layer_tensor_names(self.file, i).values())
                cause = f"{cause}; {HINT}" if cause else "no weight of it is: an activation overflowed"
                return NonFiniteError("hidden state", path=self.file.path, position=int(pos[bad]),
                                      layer=f"first in the output of layer {i}", cause=cause)
        return NonFiniteError("hidden state", path=self.file.path, cause="not seen again on a second run")

    def check_logits(self, logits: np.ndarray, positions=None, role: str = "",
                     hidden: np.ndarray | None = None) -> None:
        """Raises NonFiniteError when `logits` (n, n_vocab), or the `hidden` rows they came from
        (when the layers ran elsewhere), hold a NaN or an Inf: a max and a min on the hot path.
        `positions[i]` is row i's position in the text, `role` "target" or "draft"."""
        if not finite(logits) or (hidden is not None and not finite(hidden)):
            raise self.nonfinite_logits(logits, positions, role, hidden)

    def nonfinite_logits(self, logits: np.ndarray, positions=None, role: str = "",
                         hidden: np.ndarray | None = None) -> NonFiniteError:
        """What check_logits raises: the first bad row's position, its NaN and Inf counts, and the
        tensor at fault, looked for in the output head or, when the hidden state is bad already,
        in the layers in order (a scan of the file, made only on this failure path). A hidden
        state with an Inf may give finite logits (the matmul quantizes it by its finite values):
        it is named then."""
        logits = np.asarray(logits).reshape(-1, logits.shape[-1])
        bad = first_bad_row(logits)
        bad_hidden = None if hidden is None else first_bad_row(np.asarray(hidden).reshape(len(logits), -1))
        row = bad if bad is not None else bad_hidden if bad_hidden is not None else 0
        position = None if positions is None else int(np.asarray(positions).reshape(-1)[row])
        f = self.file
        if hidden is not None and first_bad_row(np.asarray(hidden)[row : row + 1]) is not None:
            names = [n for i in range(self.spec.n_layer) for n in layer_tensor_names(f, i).values()]
            cause = first_bad_tensor(f, names)
            where = "in the last layer's output"
            cause = f"{cause}; {HINT}" if cause else "no weight of the layers is: an activation overflowed"
        else:
            head = ["output_norm.weight", "output.weight" if "output.weight" in f.tensors else "token_embd.weight"]
            cause = first_bad_tensor(f, head)
            where = "from the output head"
            cause = f"{cause}; {HINT}" if cause else "the output head's weights are finite: an activation overflowed"
        what = f"logits ({said(*counts(logits[row]))} of {logits.shape[-1]})" if bad is not None else "hidden state"
        return NonFiniteError(what, path=f.path, role=role, position=position, layer=where, cause=cause)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Output projection of the given rows only: (n, n_embd) -> (n, n_vocab)."""
        return self.output(native.rmsnorm(hidden, self.output_norm, self.spec.rms_eps))
