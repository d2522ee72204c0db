"""lever.policy.growth: each policy's decisions, read by TreeExpand's builder and by compose."""

from __future__ import annotations

import heapq

from lever.policy.growth import POLICIES, Candidate
from lever.stages.tree_expand import FlatCost, TreeExpandConfig
from tests.stages.test_tree_expand import grow


def test_what_each_policy_decides():
    assert set(POLICIES) == {"none", "chain", "kary", "confidence", "gain-cost"}
    assert [n for n, p in POLICIES.items() if not p.drafts] == ["none"]
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
    assert min(b.gain[1:]) >= 0.3 and b.n_nodes == 1 + 3  # 0.7, 0.49, 0.343; 0.2401 is below
    lower = grow(TreeExpandConfig(policy="confidence", confidence=0.05, top_k=4, max_nodes=64))
    assert lower.n_nodes > b.n_nodes


def test_none_grows_nothing_and_kary_respects_max_depth():
    assert grow(TreeExpandConfig(policy="kary", top_k=2, kary_depth=5, max_depth=2, max_nodes=100)).n_nodes == 1 + 2 + 4
    assert POLICIES["none"].select(grow(TreeExpandConfig(policy="chain"), FlatCost())) == []
