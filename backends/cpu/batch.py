"""Several requests' tokens through one layer: each matrix once over all their rows, attention
per request over its own KV cache.

Beside `layer_forward` (backends/cpu/layer.py), for passes that verify several requests' trees
in one streamed read of the weights (issue 49): the rows of every request are stacked for the
matrix products, which give a row the same bits whatever rows stand beside it (the kernels are
batch-invariant), while each request's queries see only its own cache through its own mask.
Built from the steps `layer_forward_steps` spells out, so each request's output and cache rows
are those of its own `layer_forward`, bit for bit (tests/backends/cpu/test_batch.py).
"""

from __future__ import annotations

import attrs
import numpy as np

from lever.backends.cpu import native
from lever.backends.cpu.kv_cache import KVCache
from lever.backends.cpu.layer import PASS_CHUNK_TOKENS, LayerWeights
from lever.gguf.spec import ModelSpec


@attrs.frozen
class Segment:
    """One request's part of a batched pass: its cache, the rows its tokens write there, their
    positions, and what each of them sees of its cache."""

    cache: KVCache
    rows: slice | np.ndarray  # cache rows the tokens' k/v go to (a slice, or one row per token)
    pos: np.ndarray  # (n_tok,) int32
    mask: np.ndarray  # (n_tok, n_rows_seen) bool: cache rows [0, n_rows_seen) each token attends to

    @property
    def n_tok(self) -> int:
        return int(self.pos.size)


def layer_forward_batch(spec: ModelSpec, lw: LayerWeights, x: np.ndarray, *, segments: list[Segment], layer: int,
                        inv_freq: np.ndarray) -> np.ndarray:
    """One layer over x (sum of the segments' n_tok, n_embd), the segments' tokens stacked in
    their order: norms, projections and the FFN over every row at once, each segment's k/v
    written to its own cache and its attention over that cache alone."""
    n_tok = x.shape[0]
    if sum(s.n_tok for s in segments) != n_tok:
        raise ValueError(f"layer_forward_batch: {n_tok} rows for segments of {[s.n_tok for s in segments]} tokens")
    h = native.rmsnorm(x, lw.attn_norm, spec.rms_eps)
    q, k, v = lw.wq(h), lw.wk(h), lw.wv(h)
    for out, bias in ((q, lw.bq), (k, lw.bk), (v, lw.bv)):
        if bias is not None:
            out += bias
    q = q.reshape(n_tok, spec.n_head, spec.head_dim)
    k = k.reshape(n_tok, spec.n_head_kv, spec.head_dim)
    v = v.reshape(n_tok, spec.n_head_kv, spec.head_dim)
    if lw.q_norm is not None:
        q = native.rmsnorm(q, lw.q_norm, spec.rms_eps)
    if lw.k_norm is not None:
        k = native.rmsnorm(k, lw.k_norm, spec.rms_eps)
    pos = np.concatenate([np.asarray(s.pos, np.int32) for s in segments])
    native.rope(q, pos, spec.n_rot, inv_freq, spec.rope_neox)
    native.rope(k, pos, spec.n_rot, inv_freq, spec.rope_neox)
    attn = np.empty_like(q)  # (n_tok, n_head, head_dim)
    scale = 1.0 / float(np.sqrt(spec.head_dim))
    a = 0
    for s in segments:
        b = a + s.n_tok
        ck, cv, seen = s.cache.k[layer], s.cache.v[layer], s.mask.shape[1]
        ck[s.rows] = k[a:b]
        cv[s.rows] = v[a:b]
        attn[a:b] = native.attention(q[a:b], ck[:seen], cv[:seen], s.mask, scale)
        a = b
    x = x + lw.wo(attn.reshape(n_tok, -1))
    h = native.rmsnorm(x, lw.ffn_norm, spec.rms_eps)
    return x + lw.w_down(native.swiglu(lw.w_gate(h), lw.w_up(h)))


def layer_batch_in_chunks(spec: ModelSpec, lw: LayerWeights, x: np.ndarray, *, segments: list[Segment], layer: int,
                          inv_freq: np.ndarray, chunk: int = PASS_CHUNK_TOKENS) -> np.ndarray:
    """`layer_forward_batch` over the stacked rows at most `chunk` tokens at a time, in order,
    as `layer_in_chunks` runs one request's pass: a long prefill beside other requests' trees
    holds one chunk's activations, not the whole pass's. A segment that is one run of new rows
    after its cache is cut where a chunk ends, each piece attending over its cache up to its own
    last row (written by then: a pass lists parents first); one that is not (rows as indices: a
    pruned tree) goes whole into a chunk of its own if it does not fit."""
    out = np.empty_like(x)  # (n_tok, n_embd)
    pieces: list[Segment] = []
    a = b = 0  # the chunk being gathered: rows [a, b) of x
    for s in segments:
        start = s.rows.start if isinstance(s.rows, slice) else None
        cuttable = start is not None and s.mask.shape[1] == start + s.n_tok
        i = 0
        while i < s.n_tok:
            room = chunk - (b - a)
            if room <= 0 or (not cuttable and pieces and s.n_tok - i > room):
                out[a:b] = layer_forward_batch(spec, lw, x[a:b], segments=pieces, layer=layer, inv_freq=inv_freq)
                pieces, a = [], b
                continue
            j = min(s.n_tok, i + room) if cuttable else s.n_tok
            if i == 0 and j == s.n_tok:
                pieces.append(s)
            else:
                pieces.append(Segment(s.cache, slice(start + i, start + j), s.pos[i:j],
                                      np.ascontiguousarray(s.mask[i:j, : start + j])))
            b += j - i
            i = j
    if pieces:
        out[a:b] = layer_forward_batch(spec, lw, x[a:b], segments=pieces, layer=layer, inv_freq=inv_freq)
    return out
