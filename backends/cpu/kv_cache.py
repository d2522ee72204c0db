"""The KV cache of one model: rows of keys and values, one row per token position kept.

A pass reserves rows for its tokens, each layer writes its keys/values there, and attention
reads rows through an explicit mask. After a pass the caller decides what stays: everything
(autoregressive decoding), a prefix (`truncate`), or only some rows (`keep`, `keep_after`: the
accepted path of a token tree). Rows are stored as float16, as llama.cpp stores them.
"""

from __future__ import annotations

import numpy as np

from lever.errors import LeverError
from lever.gguf.spec import ModelSpec


class KVCache:
    DTYPE = np.float16

    @classmethod
    def bytes_for(cls, spec: ModelSpec, n_ctx: int) -> int:
        """What a cache of n_ctx rows allocates (the memory plan asks before making one)."""
        return 2 * spec.n_layer * n_ctx * spec.n_head_kv * spec.head_dim * np.dtype(cls.DTYPE).itemsize

    def __init__(self, spec: ModelSpec, n_ctx: int, dtype=DTYPE):
        self.n_ctx = n_ctx
        shape = (n_ctx, spec.n_head_kv, spec.head_dim)
        self.k = [np.zeros(shape, dtype) for _ in range(spec.n_layer)]  # per layer (n_ctx, n_kv_head, head_dim)
        self.v = [np.zeros(shape, dtype) for _ in range(spec.n_layer)]
        self.n_rows = 0  # rows in use, committed or pending

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def reserve(self, n_tok: int) -> slice:
        """Rows for the next pass's tokens, appended after the rows in use."""
        if self.n_rows + n_tok > self.n_ctx:
            raise LeverError(f"context full: {self.n_rows} + {n_tok} tokens exceed the context of {self.n_ctx}")
        rows = slice(self.n_rows, self.n_rows + n_tok)
        self.n_rows += n_tok
        return rows

    def truncate(self, n_rows: int) -> None:
        self.n_rows = min(self.n_rows, n_rows)

    def keep(self, rows: np.ndarray) -> None:
        """Keep only `rows` (ascending), moved down to be contiguous in that order."""
        rows = np.asarray(rows, np.int64)
        n_fixed = int(np.argmax(rows != np.arange(rows.size))) if rows.size and rows[-1] != rows.size - 1 else rows.size
        self.keep_after(n_fixed, rows[n_fixed:] - n_fixed)

    def keep_after(self, base: int, rows: np.ndarray) -> None:
        """Keep rows [0, base) and then rows base + `rows` (ascending), moved down after them:
        a tree's accepted path after the committed prefix. Only arrays the size of the tree are
        made, never the size of the context: a long run must not allocate more as it goes."""
        rows = np.asarray(rows, np.int64)
        if rows.size and (np.any(np.diff(rows) <= 0) or rows[0] < 0 or base + rows[-1] >= self.n_rows):
            raise ValueError("keep: rows must be ascending and in use")
        # Rows already in place are not moved: only the tail from the first row that shifts.
        moved = np.flatnonzero(rows != np.arange(rows.size))
        if moved.size:
            start = int(moved[0])
            src = base + rows[start:]
            for arrays in (self.k, self.v):
                for a in arrays:
                    a[base + start : base + rows.size] = a[src]
        self.n_rows = base + rows.size


def causal_mask(n_past: int, n_tok: int) -> np.ndarray:
    """(n_tok, n_past + n_tok) bool: token i sees the past and tokens 0..i of its batch."""
    mask = np.ones((n_tok, n_past + n_tok), bool)
    mask[:, n_past:] = np.tri(n_tok, dtype=bool)
    return mask
