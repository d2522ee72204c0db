"""The native forward pass against the numpy reference, for every architecture and type."""

from __future__ import annotations

import numpy as np
import pytest

from lever.backends.cpu.kv_cache import causal_mask
from lever.errors import LeverError
from lever.model.generate import generate
from lever.model.reference.forward import ReferenceModel
from lever.model.transformer import Model

ARCHS = ["llama", "qwen2", "qwen3"]
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"]
# Relative error (Frobenius) of native logits vs the float64 reference. Float weights differ by
# float32 arithmetic and the float16 KV cache (rounding k and v to 11 bits: ~2e-4 seen);
# quantized types also quantize activations to 8 bits per token as ggml does: ~0.7% per matmul,
# compounding over the 14 matmuls of two layers to 1-3% seen.
FLOAT_RTOL = 1e-3
QUANT_RTOL = 6e-2
LOGIT_RTOL = {"F32": FLOAT_RTOL, "F16": FLOAT_RTOL, "BF16": FLOAT_RTOL, "Q8_0": QUANT_RTOL, "Q4_0": QUANT_RTOL,
              "Q5_0": QUANT_RTOL, "Q4_K": QUANT_RTOL, "Q6_K": QUANT_RTOL}
TOKENS = [5, 17, 101, 3, 250, 44, 44, 9, 120, 7, 66, 200]


def native_logits(model: Model, tokens: list[int]) -> np.ndarray:
    n = len(tokens)
    cache = model.new_cache(64)
    hidden = model.forward(np.array(tokens), np.arange(n, dtype=np.int32), causal_mask(0, n), cache)
    return model.logits(hidden)


@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_matches_reference(tiny_model, arch, wtype):
    path = tiny_model(arch, wtype)
    got = native_logits(Model(path), TOKENS)
    want = ReferenceModel(path).logits(TOKENS)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < LOGIT_RTOL[wtype], f"{arch}/{wtype}: relative error {rel:.2e}"


@pytest.mark.parametrize("wtype", ["F32", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_equals_batch_bit_for_bit(tiny_model, arch, wtype):
    """Token by token through the cache gives the very bits of one batched pass."""
    model = Model(tiny_model(arch, wtype))
    batched = native_logits(model, TOKENS)
    cache = model.new_cache(64)
    rows = []
    for i, t in enumerate(TOKENS):
        h = model.forward(np.array([t]), np.array([i], np.int32), causal_mask(i, 1), cache)
        rows.append(model.logits(h)[0])
    assert np.array_equal(np.stack(rows), batched)


def test_tied_embeddings_and_head_dim_override(tiny_model):
    path = tiny_model("qwen3", "Q8_0", tied=True, head_dim=32)
    model = Model(path)
    assert model.output is model.tok_embd and model.spec.head_dim == 32
    got, want = native_logits(model, TOKENS), ReferenceModel(path).logits(TOKENS)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < LOGIT_RTOL["Q8_0"]


def test_tree_pass_then_keep_equals_the_chosen_branch(tiny_model):
    """A token tree verified in one pass, then `keep` of one branch, leaves the very cache rows
    (and logits) of running that branch alone: tree attention plus batch invariance."""
    model = Model(tiny_model("llama", "F32"))
    cache = model.new_cache(32)
    # root 5; children 6 and 7 (position 1); 8 under 6, 9 under 7 (position 2)
    tree_mask = np.array([[1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0],
                          [1, 0, 1, 0, 0],
                          [1, 1, 0, 1, 0],
                          [1, 0, 1, 0, 1]], bool)
    h = model.forward(np.array([5, 6, 7, 8, 9]), np.array([0, 1, 1, 2, 2], np.int32), tree_mask, cache)
    cache.keep(np.array([0, 2, 4]))
    fresh = model.new_cache(32)
    h_branch = model.forward(np.array([5, 7, 9]), np.arange(3, dtype=np.int32), causal_mask(0, 3), fresh)
    assert cache.n_rows == 3
    for a, b in zip(cache.k + cache.v, fresh.k + fresh.v):
        assert np.array_equal(a[:3], b[:3])
    assert np.array_equal(model.logits(h[[0, 2, 4]]), model.logits(h_branch))


def test_generation_stops_at_context(tiny_model):
    model = Model(tiny_model("llama", "F32"))
    res = generate(model, [1, 2, 3], n_predict=50, n_ctx=10)
    assert res.stop_reason == "context" and len(res.tokens) == 10 - 3  # prompt and reply fill the context


def test_prompt_over_context_is_an_error(tiny_model):
    model = Model(tiny_model("llama", "F32"))
    with pytest.raises(LeverError, match="over the context of 4"):
        generate(model, [1, 2, 3, 4, 5], n_predict=1, n_ctx=4)


def test_stories260k_greedy_reproduces_documented_text(stories):
    """SOURCES.md: greedy from BOS gives 'Once upon a time, there was a little girl named Lily...'."""
    from lever.gguf.tokenizer import Tokenizer

    model = Model(stories)
    tok = Tokenizer.from_gguf(stories)
    res = generate(model, [tok.bos_id], n_predict=60)
    text = tok.decode(res.tokens)
    assert text.startswith(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
        "One day, she saw a big, red ball. She wanted to play with it, but it was too"
    ), text


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("wtype", TYPES)
def test_tiles_and_mapped_rows_give_the_same_bits(tiny_model, wtype, tied):
    """A model read into the tile layout (the default: what stays resident) computes the very
    logits of the same file mapped in GGUF's row layout, and holds what its header says."""
    path = tiny_model("qwen2", wtype, tied=tied)
    tiled, mapped = Model(path), Model(path, tiles=False)
    assert {lw.wq.layout for lw in tiled.layers} == {1} and mapped.layers[0].wq.layout == 0
    np.testing.assert_array_equal(native_logits(tiled, TOKENS), native_logits(mapped, TOKENS))
    assert tiled.nbytes == Model.resident_bytes(tiled.file, tiled.spec) > 0
    assert mapped.nbytes == 4 * mapped.spec.n_embd + sum(  # mapped matrices hold no DRAM of their own
        lw.attn_norm.nbytes + lw.ffn_norm.nbytes + lw.bq.nbytes + lw.bk.nbytes + lw.bv.nbytes for lw in mapped.layers)


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("wtype", ["F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_layer_is_its_steps_bit_for_bit(tiny_model, arch, wtype, kv_dtype):
    """lever_layer_forward (one native call a layer) against layer_forward_steps (the same
    kernels called one by one from Python): the same output, the same cache rows, for a tree
    of tokens written to scattered rows after a committed prefix, on 1 and 2 threads."""
    from lever.backends.cpu import native
    from lever.backends.cpu.kv_cache import KVCache
    from lever.backends.cpu.layer import layer_forward, layer_forward_steps

    model = Model(tiny_model(arch, wtype))
    spec, lw = model.spec, model.layers[1]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, spec.n_embd)).astype(np.float32)
    prefix = 7
    mask = np.ones((5, prefix + 5), bool)
    mask[:, prefix:] = np.array([[1, 0, 0, 0, 0],
                                 [1, 1, 0, 0, 0],
                                 [1, 0, 1, 0, 0],
                                 [1, 1, 0, 1, 0],
                                 [1, 0, 1, 0, 1]], bool)
    pos = np.array([7, 8, 8, 9, 9], np.int32)
    rows = np.arange(prefix, prefix + 5)
    committed = rng.standard_normal((2, prefix, spec.n_head_kv, spec.head_dim)).astype(kv_dtype)
    outs, caches = [], []
    for fn, threads in ((layer_forward_steps, 0), (layer_forward, 1), (layer_forward, 2)):
        cache = KVCache(spec, 16, kv_dtype)
        cache.k[1][:prefix], cache.v[1][:prefix] = committed
        with native.threads(threads):
            outs.append(fn(spec, lw, x, pos=pos, mask=mask, cache=cache, layer=1,
                           rows=rows if fn is layer_forward else slice(prefix, prefix + 5), inv_freq=model.inv_freq))
        caches.append(cache)
    for out, cache in zip(outs[1:], caches[1:]):
        np.testing.assert_array_equal(out, outs[0])
        np.testing.assert_array_equal(cache.k[1], caches[0].k[1])
        np.testing.assert_array_equal(cache.v[1], caches[0].v[1])
    assert np.isfinite(outs[0]).all() and not np.array_equal(outs[0], x)


def test_native_struct_mirrors_are_the_library_structs():
    """backends/cpu/native.py's ctypes mirrors have the sizes the C structs have."""
    import ctypes

    from lever.backends.cpu import native

    assert native.struct_sizes() == (ctypes.sizeof(native.Matrix), ctypes.sizeof(native.LayerDims),
                                     ctypes.sizeof(native.LayerWeightsC))


def test_matmul_many_is_matmul_each(tiny_model):
    """One job for Q, K and V (types mixed on purpose by the file) gives each matmul's bits."""
    from lever.backends.cpu import native

    model = Model(tiny_model("qwen2", "Q4_K"))
    lw = model.layers[0]
    x = np.random.default_rng(5).standard_normal((3, model.spec.n_embd)).astype(np.float32)
    mats = [native.matrix(w.type_id, w.data, w.n_out, w.n_in, w.layout) for w in (lw.wq, lw.wk, lw.wv)]
    for got, w in zip(native.matmul_many(mats, x), (lw.wq, lw.wk, lw.wv)):
        np.testing.assert_array_equal(got, w(x))


def random_tree_mask(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A tree of n nodes listed parents first (a chain now and then, as a prompt is): its
    ancestor mask (n, n) and each node's depth."""
    chain = rng.random() < 0.3
    parents = [-1] + [i - 1 if chain else int(rng.integers(-1, i)) for i in range(1, n)]
    mask, depth = np.zeros((n, n), bool), np.zeros(n, np.int32)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask, depth


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_pass_in_chunks_is_the_pass_whole_bit_for_bit(tiny_model, arch, kv_dtype):
    """layer_in_chunks over random trees and chains, random committed prefixes and chunk sizes:
    the same output and cache rows as the whole pass, bit for bit, though the pass's own rows
    hold NaN until written (a chunk that attended to a row not yet written would show it)."""
    from lever.backends.cpu.kv_cache import KVCache
    from lever.backends.cpu.layer import layer_forward, layer_in_chunks

    model = Model(tiny_model(arch, "Q4_K"))
    spec, lw = model.spec, model.layers[0]
    rng = np.random.default_rng(11)
    for case in range(40):
        n, prefix = int(rng.integers(2, 40)), int(rng.integers(0, 20))
        chunk = int(rng.integers(1, n))
        tree, depth = random_tree_mask(rng, n)
        mask = np.ones((n, prefix + n), bool)
        mask[:, prefix:] = tree
        x = rng.standard_normal((n, spec.n_embd)).astype(np.float32)
        committed = rng.standard_normal((2, prefix, spec.n_head_kv, spec.head_dim)).astype(kv_dtype)
        outs, caches = [], []
        for fn in (layer_forward, lambda *a, **k: layer_in_chunks(layer_forward, *a, chunk=chunk, **k)):
            cache = KVCache(spec, 64, kv_dtype)
            cache.k[0][:], cache.v[0][:] = np.nan, np.nan
            cache.k[0][:prefix], cache.v[0][:prefix] = committed
            outs.append(fn(spec, lw, x, pos=(prefix + depth).astype(np.int32), mask=mask, cache=cache, layer=0,
                           rows=slice(prefix, prefix + n), inv_freq=model.inv_freq))
            caches.append(cache)
        what = f"case {case}: {n} nodes after {prefix} rows, chunks of {chunk}"
        assert np.isfinite(outs[0]).all(), what
        np.testing.assert_array_equal(outs[1], outs[0], err_msg=what)
        np.testing.assert_array_equal(caches[1].k[0][: prefix + n], caches[0].k[0][: prefix + n], err_msg=what)
        np.testing.assert_array_equal(caches[1].v[0][: prefix + n], caches[0].v[0][: prefix + n], err_msg=what)
