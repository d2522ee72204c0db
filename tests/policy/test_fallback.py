"""The fallback: simple shapes replayed on the emitted tokens, and the switch to the best of them."""

from __future__ import annotations

import pytest

from lever.policy.cost import FlatCost
from lever.policy.fallback import HOLD, MIN_TOKENS, OWN_CYCLES, ROOT, TREE, Fallback, Shape, replay_chain


def test_a_chain_replayed_takes_each_run_of_first_choices_and_the_targets_token_after():
    hits = [True, True, False, True, True, True, True, False]
    # k=2: [h h | bonus] [h h | bonus(h)] [h | bonus(miss)]: 3 cycles for 8 tokens
    assert replay_chain(hits, 2) == (8, 3)
    assert replay_chain(hits, 8) == (8, 2)  # the runs themselves: [h h miss] [h h h h miss]
    assert replay_chain([False] * 5, 3) == (5, 5)  # nothing taken: one token a pass
    assert replay_chain([], 3) == (0, 0)


def fed(fb: Fallback, hit_share: float, own_tokens: float, own_s: float) -> Fallback:
    n = max(MIN_TOKENS, 60)
    for i in range(n):
        fb.observe_hit(i, (i % 10) < 10 * hit_share)
    for _ in range(OWN_CYCLES):
        fb.observe_cycle(TREE, own_tokens, own_s)
    return fb


def test_a_chain_that_would_have_beaten_the_trees_replaces_them_for_a_while():
    cost = FlatCost(read_s=0.5, compute_per_token_s=0.001, draft_step_s=0.01)
    # the draft's first choice was right 9 times in 10, but the trees emitted 2 tokens a 0.55 s cycle
    fb = fed(Fallback(max_length=12), 0.9, 2, 0.55)
    shape = fb.choose(cost, first_child=0.9)
    assert shape.policy == "chain" and shape.length >= 6 and fb.switches == 1
    rates = fb.last_rates
    assert rates[str(shape)] > 1.05 * rates[str(TREE)]
    assert [fb.choose(cost, 0.9) for _ in range(HOLD - 1)] == [shape] * (HOLD - 1)  # held
    assert fb.choose(cost, 0.9) == TREE  # then the tree again, judged afresh
    assert fb.choose(cost, 0.9) == TREE  # (no cycles of its own yet)


def test_the_root_alone_wins_where_nodes_cost_and_the_draft_is_wrong():
    cost = FlatCost(read_s=0.0, compute_per_token_s=0.05, draft_step_s=0.02)  # compute-bound: each node costs
    fb = fed(Fallback(max_length=8), 0.0, 1, 0.2)  # nothing accepted, trees of 4 nodes
    assert fb.choose(cost, first_child=0.0) == ROOT


def test_trees_that_keep_up_are_kept():
    cost = FlatCost()
    fb = fed(Fallback(max_length=8), 0.5, 6, 0.6)  # 10 tokens/s: more than any chain on this text
    assert fb.choose(cost, first_child=0.5) == TREE and fb.switches == 0
    assert str(Shape("chain", 4)) == "chain k=4" and str(ROOT) == "none"


def test_sampled_chains_are_scored_by_the_first_child_rate():
    cost = FlatCost(read_s=0.5, compute_per_token_s=0.001, draft_step_s=0.01)
    fb = fed(Fallback(max_length=4, greedy=False), 0.0, 1, 0.5)  # no hits recorded matter when sampled
    rates = fb.rates(cost, first_child=0.5)
    assert rates[Shape("chain", 2)] == pytest.approx((1 + 0.5 + 0.25) / cost.cycle_s(3, 0.02, 1.75))
