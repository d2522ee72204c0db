"""The node arrays on their own: adding, finding, merging, the rows a forward must run."""

from __future__ import annotations

import pytest

from lever.policy.growth import Candidate, Source
from lever.tree.nodes import Nodes


def small() -> Nodes:
    """root 5 -> 10 (gain 0.7) -> 11 (0.49); root -> 12 (0.1)."""
    n = Nodes()
    n.add(5, -1, 1.0)
    n.add(10, 0, 0.7, q=0.7)
    n.add(11, 1, 0.49, q=0.7)
    n.add(12, 0, 0.1, q=0.1, rank=1, source=Source.NGRAM)
    return n


def test_a_node_knows_its_depth_path_and_place_among_its_siblings():
    n = small()
    assert len(n) == 4 and n.parents == [-1, 0, 1, 0] and n.depth == [0, 1, 2, 1]
    assert n.path(2) == [10, 11] and n.path(0) == [] and n.path(3) == [12]
    assert n.child(0, 10) == 1 and n.child(1, 11) == 2 and n.child(0, 11) is None
    assert n.row == [-1] * 4 and n.source[3] == Source.NGRAM and n.rank[3] == 1


def test_expected_accepted_is_the_sum_of_the_gains_below_the_root():
    assert small().expected_accepted() == pytest.approx(0.7 + 0.49 + 0.1)


def test_a_second_source_of_a_node_keeps_the_better_gain_and_is_noted():
    n = small()
    node = n.merge(Candidate(-0.3, 0, 0, 12, 0.4, 0, Source.MODEL))  # the model proposes 12 too, more sure
    assert node == 3 and n.gain[3] == pytest.approx(0.3) and n.also[3] == [(Source.MODEL, 0.4, 0)]
    n.merge(Candidate(-0.01, 1, 0, 12, 0.01, 3, Source.PROMPT_LOOKUP))  # a worse estimate changes no gain
    assert n.gain[3] == pytest.approx(0.3) and len(n.also[3]) == 2


def test_a_forward_runs_the_ancestors_the_draft_never_ran_first_and_each_once():
    n = small()
    n.set_row(0, 0)  # only the root was run
    assert n.node_of_row == {0: 0} and n.row[0] == 0
    assert n.with_unrun_ancestors([2, 3]) == [1, 2, 3]  # 1 before its child 2, the root never
    assert n.with_unrun_ancestors([2, 1]) == [1, 2]  # 1 once
    n.set_row(1, 1)
    assert n.with_unrun_ancestors([2]) == [2]
