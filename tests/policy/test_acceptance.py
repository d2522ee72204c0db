"""The acceptance table: the identity before data, the observed rate once data outweighs it."""

from __future__ import annotations

import pytest

from lever.policy.acceptance import AcceptanceTable


def test_identity_until_observed():
    c = AcceptanceTable()
    assert c(0.37, 0) == pytest.approx(0.37) and c(0.05, 3) == pytest.approx(0.05)


def test_learns_per_rank_and_bin():
    c = AcceptanceTable(prior_weight=4)
    for _ in range(96):
        c.observe(0.65, 0, True)  # first choices at ~0.65: always accepted
        c.observe(0.15, 2, False)  # later choices at ~0.15: never
    assert c(0.62, 0) > 0.95 and c(0.12, 1) < 0.03
    assert c(0.35, 0) == pytest.approx(0.35)  # other cells keep the identity
    assert [(r, n) for r, _, n, _ in c.table()] == [(0, 96), (1, 96)]


def test_one_lucky_hit_does_not_make_an_unlikely_sibling_likely():
    c = AcceptanceTable(prior_weight=1.0, shaped=True)
    c.observe(0.05, 1, True)
    c.observe(0.05, 1, False)
    # one pseudo-observation would read (1 + 0.011) / 3 = 0.34; the prior weighs 20 here
    assert c(0.05, 1) == pytest.approx((1 + 20 * 0.05**1.5) / 22)
    for _ in range(200):
        c.observe(0.05, 1, True)  # and enough data still overrules it
    assert c(0.05, 1) > 0.85


def test_first_child_is_the_share_accepted_leaning_on_the_identity_before_data():
    c = AcceptanceTable(prior_weight=4)
    assert c.first_child() == pytest.approx(0.5)
    assert c.first_child(proposed_q=0.81) == pytest.approx(0.81)  # the identity at the draft's first choices
    assert AcceptanceTable(shaped=True).first_child(proposed_q=0.81) == pytest.approx(0.9)
    for i in range(40):
        c.observe(0.45, 0, i % 10 != 0)  # 90% of first children accepted at q ~0.45
        c.observe(0.3, 1, False)  # later children do not count
    assert c.first_child() == pytest.approx((36 + 4 * 0.45) / 44)


def test_a_free_sources_cells_start_at_its_pooled_acceptance():
    """A free source's q is a confidence: its cells lean on what the source as a whole achieved,
    a pessimistic guess before anything, and the first trials overrule that guess."""
    c = AcceptanceTable(pooled_prior=0.1, pooled_weight=1.0, prior_weight=4)
    assert c(1.0, 0) == pytest.approx(0.1) and c(0.25, 0) == pytest.approx(0.1)
    for _ in range(9):
        c.observe(0.95, 0, True)  # long matches, always right
    c.observe(0.25, 0, False)
    pooled = (9 + 0.1) / 11
    assert c.pooled() == pytest.approx(pooled)
    assert c(0.9, 0) == pytest.approx((9 + 4 * pooled) / 13)  # a cell with data: mostly its own
    assert c(0.55, 0) == pytest.approx(pooled)  # a cell without: the source's
    assert c(0.25, 0) == pytest.approx(4 * pooled / 5)


def test_every_proposal_at_an_emitted_token_is_a_trial():
    c = AcceptanceTable()
    c.observe_proposals([7, 8, 9, -1], [0.6, 0.2, 0.1, 0.0], target=8)  # the second choice was the target's
    assert c.trials[0].sum() == 1 and c.accepted[0].sum() == 0  # padding (-1) is no trial
    assert c.trials[1].sum() == 2 and c.accepted[1].sum() == 1


def test_a_tree_is_scored_by_the_chance_of_reaching_each_node():
    c = AcceptanceTable()  # the identity: a node's acceptance is its q
    # root, a chain 0.8 -> 0.5, and a sibling 0.1 of the first
    parents, q, rank = [-1, 0, 1, 0], [1.0, 0.8, 0.5, 0.1], [0, 0, 0, 1]
    assert c.score(parents, q, rank) == pytest.approx(0.8 + 0.8 * 0.5 + 0.1)
    # a free source's node (model False) keeps its own estimate: its gain over its parent's
    gains = [1.0, 0.8, 0.6, 0.1]
    assert c.score(parents, q, rank, gains, [True, True, False, True]) == pytest.approx(0.8 + 0.6 + 0.1)


def test_the_shaped_prior_takes_first_choices_above_their_probability_and_later_ones_below():
    c = AcceptanceTable(prior_weight=1.0, shaped=True)
    assert c(0.49, 0) == pytest.approx(0.7) and c(0.49, 2) == pytest.approx(0.49**1.5)
    for _ in range(99):
        c.observe(0.45, 0, False)  # the data overrules it (the prior weighs 1 / 0.67 observations)
    w = 1 / 0.45**0.5
    assert c(0.45, 0) == pytest.approx(w * 0.45**0.5 / (99 + w))
