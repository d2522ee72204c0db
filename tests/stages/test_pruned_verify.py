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


def random_tree(rng: np.random.Generator, pass_id: int, n: int, vocab: int, keep) -> TokenTree:
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int32)
    return TokenTree(pass_id, rng.integers(0, vocab, n), parents, keep=keep)


def kept_path(rng: np.random.Generator, tree: TokenTree) -> tuple[int, ...]:
    """The rows of a root-to-node path of `tree`, as Accept keeps them."""
    node, path = int(rng.integers(0, tree.n_nodes)), []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return tuple(reversed(path))


def test_trees_of_several_requests_in_one_pass_are_each_verified_as_alone(tiny_model):
    """verify_batch over 1-4 requests, each with its own prompt, cache and kept rows, for
    several passes: every request's hidden states equal its own verify's, bit for bit, and its
    cache holds the same rows (whatever shares the pass, in any order)."""
    model = Model(tiny_model("qwen2", "Q4_K", n_layer=2))
    layers, vocab = dict(enumerate(model.layers)), model.spec.n_vocab
    rng = np.random.default_rng(49)
    for case in range(12):
        n_req = int(rng.integers(1, 5))
        batched, alone = [make(model) for _ in range(n_req)], [make(model) for _ in range(n_req)]
        for b, a in zip(batched, alone):
            prompt = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 8)))]
            b.verify(TokenTree.chain(0, prompt), layers)
            a.verify(TokenTree.chain(0, prompt), layers)
        last: list[TokenTree | None] = [None] * n_req
        for pass_id in range(1, 4):
            trees = [random_tree(rng, pass_id, int(rng.integers(1, 7)), vocab,
                                 kept_path(rng, t) if t is not None else None) for t in last]
            order = rng.permutation(n_req)  # who stands where in the pass changes nothing
            got = PrunedVerify.verify_batch([batched[i] for i in order], [trees[i] for i in order], layers)
            for j, i in enumerate(order):
                want = alone[i].verify(trees[i], layers)
                what = f"case {case}, pass {pass_id}, request {i} of {n_req}"
                assert np.array_equal(got[j].hidden, want.hidden), what
                assert batched[i].cache.n_rows == alone[i].cache.n_rows, what
                rows = batched[i].cache.n_rows
                assert all(np.array_equal(bk[:rows], ak[:rows]) for bk, ak in
                           zip(batched[i].cache.k, alone[i].cache.k)), what
            last = trees
