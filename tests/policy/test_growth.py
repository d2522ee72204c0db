"""lever.policy.growth: each policy's decisions, read by TreeExpand's builder and by compose."""

from __future__ import annotations

import heapq

from lever.policy.cost import FlatCost
from lever.policy.growth import POLICIES, Candidate
from lever.tree.config import TreeExpandConfig
from tests.tree.test_builder import grow


def test_what_each_policy_decides():
    assert set(POLICIES) == {"none", "chain", "kary", "confidence", "gain-cost"}
    assert [n for n, p in POLICIES.items() if not p.speculates] == ["none"]
    assert [n for n, p in POLICIES.items() if p.full_lm_head] == ["confidence"]  # EdgeLLM verifies with it
    assert [n for n, p in POLICIES.items() if p.learns_acceptance] == ["gain-cost"]
    assert TreeExpandConfig(policy="kary").growth is POLICIES["kary"]


def test_candidates_pop_by_gain_then_by_order_proposed():
    heap = []
    for c in (Candidate(-0.2, 0, 0, 7, 0.2, 1), Candidate(-0.5, 1, 0, 8, 0.5, 0), Candidate(-0.5, 2, 1, 9, 0.5, 0)):
        heapq.heappush(heap, c)
    assert [heapq.heappop(heap).token for _ in range(3)] == [8, 9, 7]
    assert Candidate(-0.5, 1, 0, 8, 0.5, 0).gain == 0.5


def test_confidence_stops_at_its_bar():
    # FakeDraft: first child 0.7, then 0.1 each. Paths: 0.7, 0.49, 0.343, ... and 0.07 for others.
    b = grow(TreeExpandConfig(policy="confidence", confidence=0.3, top_k=4, max_nodes=64))
    assert min(b.nodes.gain[1:]) >= 0.3 and b.n_nodes == 1 + 3  # 0.7, 0.49, 0.343; 0.2401 is below
    lower = grow(TreeExpandConfig(policy="confidence", confidence=0.05, top_k=4, max_nodes=64))
    assert lower.n_nodes > b.n_nodes


def test_none_grows_nothing_and_kary_respects_max_depth():
    assert grow(TreeExpandConfig(policy="kary", top_k=2, kary_depth=5, max_depth=2, max_nodes=100)).n_nodes == 1 + 2 + 4
    assert POLICIES["none"].select(grow(TreeExpandConfig(policy="chain"), FlatCost())) == []


def test_gain_cost_adds_proposed_children_without_paying_a_forward_and_expands_only_what_pays():
    # a forward dearer than the whole pass: no node's children can pay for one, but the root's
    # proposals are already drafted, so the likely first child still joins (it costs its row)
    dear = grow(TreeExpandConfig(policy="gain-cost", max_nodes=64),
                FlatCost(read_s=0.05, compute_per_token_s=0.0001, draft_step_s=1.0))
    assert dear.n_nodes >= 2 and max(dear.nodes.depth) == 1
    assert dear.nodes.row[1:] == [-1] * (dear.n_nodes - 1)  # none of them was expanded
    cheap = grow(TreeExpandConfig(policy="gain-cost", max_nodes=64),
                 FlatCost(read_s=0.05, compute_per_token_s=0.0001, draft_step_s=0.001))
    assert max(cheap.nodes.depth) > 3

