"""layer_forward_batch: several requests' tokens through one layer, each request's output and
cache rows its own layer_forward's, bit for bit, whatever shares the batch; and run a chunk of
rows at a time (layer_batch_in_chunks), the same bits."""

from __future__ import annotations

import numpy as np
import pytest

from lever.backends.cpu import native
from lever.backends.cpu.batch import Segment, layer_batch_in_chunks, layer_forward_batch
from lever.backends.cpu.kv_cache import KVCache
from lever.backends.cpu.layer import layer_forward
from lever.model.transformer import Model
from tests.model.test_transformer import random_tree_mask


def request(rng: np.random.Generator, spec, kv_dtype, n_ctx: int = 96, max_nodes: int = 24):
    """One request's state before a pass: a cache with a committed prefix, a tree after it, the
    rows past the prefix NaN (a pass that reads a row before writing it gives NaN)."""
    n, prefix = int(rng.integers(1, max_nodes)), int(rng.integers(0, 40))
    cache = KVCache(spec, n_ctx, kv_dtype)
    for layer in range(spec.n_layer):
        cache.k[layer][:] = np.nan
        cache.v[layer][:] = np.nan
    for layer in range(spec.n_layer):
        cache.k[layer][:prefix] = rng.standard_normal((prefix, spec.n_head_kv, spec.head_dim))
        cache.v[layer][:prefix] = rng.standard_normal((prefix, spec.n_head_kv, spec.head_dim))
    cache.n_rows = prefix
    tree, depth = random_tree_mask(rng, n)
    mask = np.ones((n, prefix + n), bool)
    mask[:, prefix:] = tree
    x = rng.standard_normal((n, spec.n_embd)).astype(np.float32)
    return cache, x, (prefix + depth).astype(np.int32), mask


def copy_cache(spec, cache: KVCache) -> KVCache:
    out = KVCache(spec, cache.n_ctx, cache.k[0].dtype)
    for layer in range(len(cache.k)):
        out.k[layer][:], out.v[layer][:] = cache.k[layer], cache.v[layer]
    out.n_rows = cache.n_rows
    return out


def assert_each_alone(model, layer: int, reqs, alone_caches, together: np.ndarray, what: str) -> None:
    """Each request's rows of `together` and its cache's rows equal its own layer_forward's."""
    a = 0
    for (cache, x, pos, mask), alone_cache in zip(reqs, alone_caches):
        rows = slice(alone_cache.n_rows, alone_cache.n_rows + x.shape[0])
        alone = layer_forward(model.spec, model.layers[layer], x, pos=pos, mask=mask, cache=alone_cache, layer=layer,
                              rows=rows, inv_freq=model.inv_freq)
        np.testing.assert_array_equal(together[a : a + x.shape[0]], alone, err_msg=what)
        np.testing.assert_array_equal(cache.k[layer], alone_cache.k[layer], err_msg=what)
        np.testing.assert_array_equal(cache.v[layer], alone_cache.v[layer], err_msg=what)
        a += x.shape[0]
    assert np.isfinite(together).all()


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("arch, wtype", [("llama", "Q4_K"), ("qwen2", "Q8_0"), ("qwen3", "Q6_K")])
def test_each_request_in_a_batch_gets_its_own_layer_forward_bit_for_bit(tiny_model, arch, wtype, kv_dtype):
    model = Model(tiny_model(arch, wtype))
    spec, inv_freq = model.spec, model.inv_freq
    rng = np.random.default_rng(49)
    for case in range(30):
        reqs = [request(rng, spec, kv_dtype) for _ in range(int(rng.integers(1, 5)))]
        layer, threads = int(rng.integers(0, spec.n_layer)), int(rng.integers(1, 3))
        alone_caches = [copy_cache(spec, c) for c, *_ in reqs]
        segments = [Segment(c, slice(c.n_rows, c.n_rows + x.shape[0]), pos, mask) for c, x, pos, mask in reqs]
        with native.threads(threads):
            together = layer_forward_batch(spec, model.layers[layer], np.concatenate([x for _, x, *_ in reqs]),
                                           segments=segments, layer=layer, inv_freq=inv_freq)
        assert_each_alone(model, layer, reqs, alone_caches, together,
                          f"case {case}: {len(reqs)} requests, layer {layer}, {threads} threads")


def test_rows_that_do_not_add_up_to_the_segments_are_refused(tiny_model):
    model = Model(tiny_model("llama", "F32"))
    rng = np.random.default_rng(0)
    cache, x, pos, mask = request(rng, model.spec, np.float32)
    seg = Segment(cache, slice(cache.n_rows, cache.n_rows + x.shape[0]), pos, mask)
    with pytest.raises(ValueError, match="rows for segments"):
        layer_forward_batch(model.spec, model.layers[0], np.concatenate([x, x[:1]]), segments=[seg], layer=0,
                            inv_freq=model.inv_freq)


@pytest.mark.parametrize("arch, wtype", [("llama", "Q4_K"), ("qwen3", "Q6_K")])
def test_a_batch_in_chunks_is_each_requests_own_layer_forward_bit_for_bit(tiny_model, arch, wtype):
    """Chunks of 1-40 rows cut the requests anywhere (a long prefill beside trees); a request
    whose rows are indices (a pruned tree) is never cut. Each request's output and cache are its
    own layer_forward's; a chunk run before the rows it attends to are written would read NaN."""
    model = Model(tiny_model(arch, wtype))
    spec, inv_freq = model.spec, model.inv_freq
    rng = np.random.default_rng(4949)
    for case in range(40):
        reqs = [request(rng, spec, np.float16, n_ctx=160, max_nodes=90) for _ in range(int(rng.integers(1, 5)))]
        layer, chunk = int(rng.integers(0, spec.n_layer)), int(rng.integers(1, 41))
        alone_caches = [copy_cache(spec, c) for c, *_ in reqs]
        indexed = [bool(rng.random() < 0.25) for _ in reqs]
        segments = [Segment(c, np.arange(c.n_rows, c.n_rows + x.shape[0]) if ix else
                            slice(c.n_rows, c.n_rows + x.shape[0]), pos, mask)
                    for (c, x, pos, mask), ix in zip(reqs, indexed)]
        together = layer_batch_in_chunks(spec, model.layers[layer], np.concatenate([x for _, x, *_ in reqs]),
                                         segments=segments, layer=layer, inv_freq=inv_freq, chunk=chunk)
        assert_each_alone(model, layer, reqs, alone_caches, together,
                          f"case {case}: {len(reqs)} requests, chunk {chunk}, indexed {indexed}")
