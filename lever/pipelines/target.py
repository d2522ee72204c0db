"""The target model on the flash backend: what every pipeline verifies with.

`FlashTarget.open` reads the resident layers once (packed into the tile layout), keeps the
embeddings and the output head in DRAM, and leaves the other layers to the flash store, which
Prefetch streams through the DRAM window on every pass.
"""

from __future__ import annotations

import attrs
import numpy as np

from lever.backends.cpu import native
from lever.backends.cpu.layer import load_layer, tiled_weight
from lever.backends.flash import FlashConfig, FlashStore
from lever.errors import LeverError
from lever.gguf.file import GGUFFile
from lever.model.transformer import Model
from lever.pipelines.residency import Residency


@attrs.define
class FlashTarget:
    """The target model with its layers on the flash backend."""

    model: Model  # embeddings and output head (resident); no layers
    store: FlashStore
    resident: Residency  # the layers kept in DRAM now: a live memory budget changes them between passes

    @classmethod
    def open(cls, path, flash: FlashConfig, file: GGUFFile | None = None,
             resident: frozenset[int] | None = None) -> FlashTarget:
        """`resident`: the layers to keep in DRAM (a RunPlan's); None: planned from `flash`."""
        f = file or GGUFFile(path)
        model = Model(file=f, load_layers=False, tiles=False)
        store = FlashStore(path, flash, file=f, resident=resident)
        try:
            # Resident layers are read once through the store and packed into the tile layout
            # (the kernels' fastest form); their read buffer goes back once packed.
            layers = {}
            for i in sorted(store.resident):
                layers[i] = load_layer(f, model.spec, i, raws=store.resident_layer(i), tiles=True)
                store.drop_resident(i)
            resident = Residency(store, f, model.spec, layers)
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
        return self.resident.nbytes

    @property
    def head_bytes(self) -> int:
        """The output projection, kept resident: Accept runs it on the CPU every cycle."""
        return self.model.output.nbytes

    @property
    def window_bytes(self) -> int:
        pool = self.store.pool
        return pool.n_buffers * pool.buffer_bytes if pool and self.resident.streamed() else 0

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
