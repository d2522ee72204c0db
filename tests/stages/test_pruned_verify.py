"""PrunedVerify's pass without an event loop: a tree's hidden states and the keep protocol."""

from __future__ import annotations

import numpy as np

from lever.backends.cpu.kv_cache import KVCache, causal_mask
from lever.dataflow.messages import TokenTree
from lever.model.transformer import Model
from lever.stages.pruned_verify import PrunedVerify


def make(model: Model) -> PrunedVerify:
    spec = model.spec
    return PrunedVerify("verify", spec, model.embed, KVCache(spec, 64), dict(enumerate(model.layers)))


def test_tree_rows_equal_each_branch_run_alone(tiny_model):
    model = Model(tiny_model("qwen3", "Q4_0", n_layer=2))
    v = make(model)
    layers = dict(enumerate(model.layers))
    v.verify(TokenTree.chain(0, [3, 4, 5]), layers)  # prefill
    # root 9 (position 3) with children 10 and 11, and 12 under 11
    tree = TokenTree(1, np.array([9, 10, 11, 12]), np.array([-1, 0, 0, 2], np.int32), keep=None)
    out = v.verify(tree, layers)
    for node, path in ((1, [3, 4, 5, 9, 10]), (3, [3, 4, 5, 9, 11, 12])):
        n = len(path)
        h = model.forward(np.array(path), np.arange(n, dtype=np.int32), causal_mask(0, n), model.new_cache(n))
        assert np.array_equal(out.hidden[node], h[-1])
    assert v.token_layers == (3 + 4) * 2


def test_commit_keeps_the_accepted_rows(tiny_model):
    model = Model(tiny_model("llama", "F32", n_layer=2))
    v = make(model)
    layers = dict(enumerate(model.layers))
    v.verify(TokenTree.chain(0, [3, 4]), layers)
    v.verify(TokenTree(1, np.array([9, 10, 11]), np.array([-1, 0, 0], np.int32)), layers)
    out = v.verify(TokenTree(2, np.array([7]), np.array([-1], np.int32), keep=(0, 2)), layers)  # kept 9, 11
    assert v.cache.n_rows == 2 + 2 + 1
    path = [3, 4, 9, 11, 7]
    h = model.forward(np.array(path), np.arange(5, dtype=np.int32), causal_mask(0, 5), model.new_cache(5))
    assert np.array_equal(out.hidden[0], h[-1])
