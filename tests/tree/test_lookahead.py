"""Drafting ahead on its own: finding the next root among rows drafted ahead, and starting from them."""

from __future__ import annotations

import types

import numpy as np

from lever.dataflow.messages import Accepted, Proposals
from lever.policy.cost import FlatCost
from lever.tree import lookahead
from lever.tree.builder import TreeBuilder
from lever.tree.config import TreeExpandConfig
from lever.tree.lookahead import Lookahead
from lever.tree.nodes import Nodes


def sent_tree() -> types.SimpleNamespace:
    """A sent chain 5 -> 10 -> 11 (rows 0, 1, 2), then drafted ahead below 11: 12 (row 3) with
    its child 13 (row 4), and 14 (row 5); and 15 below 10, never run (row -1)."""
    n = Nodes()
    for tok, parent in ((5, -1), (10, 0), (11, 1), (12, 2), (13, 3), (14, 2), (15, 1)):
        n.add(tok, parent, 0.5)
    for node, row in ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5)):
        n.set_row(node, row)
    props = {r: Proposals(np.array([20 + r, 30 + r]), np.array([0.6, 0.2], np.float32)) for r in range(6)}
    return types.SimpleNamespace(nodes=n, n_sent=3, proposals=props)


def test_a_right_guess_carries_the_new_root_and_its_drafted_subtree():
    prev = sent_tree()
    assert lookahead.carry_for(prev, Accepted(1, (10, 11, 12), (0, 1, 2))) == (3, 4)
    assert lookahead.carry_for(prev, Accepted(1, (10, 11, 14), (0, 1, 2))) == (5,)


def test_a_wrong_guess_or_a_root_never_drafted_carries_nothing():
    prev = sent_tree()
    assert lookahead.carry_for(prev, Accepted(1, (10, 11, 99), (0, 1, 2))) == ()  # never drafted
    assert lookahead.carry_for(prev, Accepted(1, (10, 15), (0, 1))) == ()  # 15 joined, never ran


def test_the_next_tree_takes_over_the_rows_renumbered_from_zero():
    prev = sent_tree()
    b = TreeBuilder(TreeExpandConfig(policy="chain", chain_length=3), FlatCost(), cycle=2, room=100)
    b.add(12, -1, 1.0)
    lookahead.adopt(b, prev, (3, 4))
    assert b.nodes.row[0] == 0 and b.n_pending == 2
    assert b.ahead.carried == {(0, 13): 1}  # 13 below the new root is row 1 now
    assert b.proposals[0] is prev.proposals[3] and b.proposals[1] is prev.proposals[4]
    assert sorted(c.token for c in b.heap) == [23, 33]  # the root's children are candidates at once


def test_a_carried_row_is_found_by_its_parents_row_and_token():
    la = Lookahead(carried={(0, 13): 1})
    n = Nodes()
    n.add(12, -1, 1.0)
    assert la.carried_row(n, 0, 13) is None  # the root has no row yet
    n.set_row(0, 0)
    assert la.carried_row(n, 0, 13) == 1 and la.carried_row(n, 0, 14) is None
