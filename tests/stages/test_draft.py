"""Draft's core without an event loop: tree expansion over its own cache, and commits that
leave exactly the rows of the accepted text."""

from __future__ import annotations

import numpy as np

from lever.backends.cpu.kv_cache import causal_mask
from lever.dataflow.messages import ExpandRequest
from lever.model.transformer import Model
from lever.stages.draft import Drafter, softmax_top_k


def direct_probs(model: Model, tokens: list[int]) -> np.ndarray:
    """The draft's next-token distribution after `tokens`, computed from scratch."""
    n = len(tokens)
    h = model.forward(np.array(tokens), np.arange(n, dtype=np.int32), causal_mask(0, n), model.new_cache(n))
    return softmax_top_k(model.logits(h[-1:]), 4)


def test_expansions_match_running_each_path_from_scratch(tiny_model):
    model = Model(tiny_model("qwen2", "Q8_0", n_layer=2))
    core = Drafter(model, model.new_cache(64))
    prompt = [3, 4, 5]
    core.expand(ExpandRequest(0, np.array(prompt), np.array([-1, 0, 1], np.int32), 4, n_given=3, keep=()))
    # cycle 1: root 7 after the prompt; then two children of the root in one batched forward
    e1 = core.expand(ExpandRequest(1, np.array([7]), np.array([-1], np.int32), 4, keep=(0, 1, 2)))
    e2 = core.expand(ExpandRequest(1, np.array([11, 12]), np.array([0, 0], np.int32), 4))
    assert e1.rows.tolist() == [0] and e2.rows.tolist() == [1, 2]
    for got_t, got_p, path in ((e1.child_tokens[0], e1.child_probs[0], prompt + [7]),
                               (e2.child_tokens[0], e2.child_probs[0], prompt + [7, 11]),
                               (e2.child_tokens[1], e2.child_probs[1], prompt + [7, 12])):
        want_t, want_p = direct_probs(model, path)
        assert got_t.tolist() == want_t[0].tolist()
        assert np.array_equal(got_p, want_p[0])  # batch-invariant kernels: the same bits


def test_commit_keeps_the_accepted_path_only(tiny_model):
    model = Model(tiny_model("llama", "F32", n_layer=2))
    core = Drafter(model, model.new_cache(64))
    core.expand(ExpandRequest(0, np.array([3, 4]), np.array([-1, 0], np.int32), 2, n_given=2, keep=()))
    core.expand(ExpandRequest(1, np.array([7]), np.array([-1], np.int32), 2, keep=(0, 1)))
    core.expand(ExpandRequest(1, np.array([11, 12]), np.array([0, 0], np.int32), 2))
    # accepted: 7 then 12 (pending rows 0 and 2); the next root is 9
    e = core.expand(ExpandRequest(2, np.array([9]), np.array([-1], np.int32), 4, keep=(0, 2)))
    assert core.n_committed == 4  # 3, 4, 7, 12
    want_t, want_p = direct_probs(model, [3, 4, 7, 12, 9])
    assert e.child_tokens[0].tolist() == want_t[0].tolist() and np.array_equal(e.child_probs[0], want_p[0])


def test_commit_can_carry_rows_drafted_ahead(tiny_model):
    """Rows drafted past the tree (the next root and its child) stay pending through a keep,
    renumbered from 0, and what hangs off them equals running the path from scratch."""
    model = Model(tiny_model("qwen2", "Q8_0", n_layer=2))
    core = Drafter(model, model.new_cache(64))
    core.expand(ExpandRequest(0, np.array([3, 4]), np.array([-1, 0], np.int32), 4, n_given=2, keep=()))
    core.expand(ExpandRequest(1, np.array([7]), np.array([-1], np.int32), 4, keep=(0, 1)))  # row 0
    core.expand(ExpandRequest(1, np.array([11, 12]), np.array([0, 0], np.int32), 4))  # rows 1, 2
    core.expand(ExpandRequest(1, np.array([9]), np.array([2], np.int32), 4, ahead=True))  # row 3: 12's child
    core.expand(ExpandRequest(1, np.array([5]), np.array([3], np.int32), 4, ahead=True))  # row 4: 9's child
    # accepted 7, 12; the target's next token is 9, drafted ahead: rows 3 and 4 carry over
    e = core.expand(ExpandRequest(2, np.array([6]), np.array([1], np.int32), 4, keep=(0, 2), carry=(3, 4)))
    assert core.n_committed == 4 and core.pending_parents == [-1, 0, 1]  # 9, 5 (carried), 6 (new)
    want_t, want_p = direct_probs(model, [3, 4, 7, 12, 9, 5, 6])
    assert e.rows.tolist() == [2]
    assert e.child_tokens[0].tolist() == want_t[0].tolist() and np.array_equal(e.child_probs[0], want_p[0])


def test_a_commit_alone_is_an_empty_expansion(tiny_model):
    model = Model(tiny_model("llama", "F32", n_layer=1))
    core = Drafter(model, model.new_cache(64))
    core.expand(ExpandRequest(0, np.array([3, 4]), np.array([-1, 0], np.int32), 2, n_given=2, keep=()))
    e = core.expand(ExpandRequest(1, np.zeros(0, np.int64), np.zeros(0, np.int32), 2, keep=(0, 1)))
    assert e.rows.size == 0 and core.n_committed == 2 and core.cache.n_rows == 2


def test_given_tokens_can_bring_their_proposals_too(tiny_model):
    """A cycle's given tokens (accepted leaves the draft never ran) return the draft's top-k at
    them when asked, equal to running their paths from scratch; the expanded rows are as without."""
    model = Model(tiny_model("qwen2", "Q8_0", n_layer=2))
    core = Drafter(model, model.new_cache(64))
    core.expand(ExpandRequest(0, np.array([3, 4]), np.array([-1, 0], np.int32), 4, n_given=2, keep=()))
    core.expand(ExpandRequest(1, np.array([7]), np.array([-1], np.int32), 4, keep=(0, 1)))
    e = core.expand(ExpandRequest(2, np.array([6, 9]), np.array([-1, 0], np.int32), 4, n_given=1, keep=(0,),
                                  given_proposals=True))
    assert e.rows.tolist() == [1] and e.given[0].shape == (1, 4)
    want_t, want_p = direct_probs(model, [3, 4, 7, 6])
    assert e.given[0][0].tolist() == want_t[0].tolist() and np.array_equal(e.given[1][0], want_p[0])
    want_t, want_p = direct_probs(model, [3, 4, 7, 6, 9])
    assert e.child_tokens[0].tolist() == want_t[0].tolist() and np.array_equal(e.child_probs[0], want_p[0])
