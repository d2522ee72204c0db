"""lever.dataflow.messages: the tree's own arithmetic (depths, who sees whom, children, paths)."""

from __future__ import annotations

import numpy as np

from lever.dataflow.messages import TokenTree, children_of, likely_path

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
PARENTS = [-1, 0, 0, 1, 1, 2]


def tree(probs=None) -> TokenTree:
    return TokenTree(3, np.arange(10, 16), np.asarray(PARENTS, np.int32),
                     gains=None if probs is None else np.asarray(probs, np.float32))


def test_depths_children_and_ancestors():
    t = tree()
    assert t.n_nodes == 6 and t.depths().tolist() == [0, 1, 1, 2, 2, 2]
    assert children_of(t) == [[1, 2], [3, 4], [5], [], [], []]
    m = t.ancestor_mask()
    assert [np.flatnonzero(m[i]).tolist() for i in range(6)] == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5]]


def test_a_chain_is_a_tree_of_one_path():
    t = TokenTree.chain(0, [7, 8, 9], keep=())
    assert t.parents.tolist() == [-1, 0, 1] and t.n_given == 3 and t.keep == ()
    assert t.ancestor_mask().sum() == 6  # lower triangle: causal


def test_likely_path_follows_the_draft_and_stops_where_asked():
    t = tree(probs=[1.0, 0.3, 0.6, 0.2, 0.7, 0.9])
    kids = children_of(t)
    assert likely_path(t, kids, 0) == [0, 2, 5]
    assert likely_path(t, kids, 1) == [1, 4]
    assert likely_path(t, kids, 0, n=2) == [0, 2]
    assert likely_path(tree(), kids, 0) == [0, 1, 3]  # no probabilities: the first child
