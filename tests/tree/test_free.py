"""The free sources' side of a tree on its own: what they propose where, and the chain a forward reads."""

from __future__ import annotations

import attrs
import pytest

from lever.policy.acceptance import AcceptanceTable
from lever.policy.growth import Source
from lever.policy.lookup import Lookup
from lever.tree.free import JUMP_TOKENS, FreeSources
from lever.tree.nodes import Nodes


def sources(text: list[int], tables=None) -> FreeSources:
    lk = Lookup((Source.PROMPT_LOOKUP,))
    lk.extend(text)
    return FreeSources(lk, tables or {})


@attrs.define
class Tree:
    """The little of a TreeBuilder the free sources use: the arrays, adding, a cap."""

    free: FreeSources
    limit: int = 64
    nodes: Nodes = attrs.field(factory=Nodes)

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    def add(self, token, parent, gain, q=1.0, rank=0, source=Source.MODEL) -> int:
        node = self.nodes.add(token, parent, gain, q, rank, source)
        self.free.propose(self.nodes, node, self.expandable(node))
        return node

    def expandable(self, node: int) -> bool:
        return self.nodes.depth[node] < 30


def test_the_root_gets_what_followed_the_text_priced_by_the_sources_table():
    table = AcceptanceTable(pooled_prior=0.9)
    free = sources([7, 5, 20, 9, 7, 5], {Source.PROMPT_LOOKUP: table})  # "7 5" was followed by 20
    t = Tree(free)
    t.add(5, -1, 1.0)
    (c,) = free.heap
    assert (c.parent, c.token, c.source) == (0, 20, Source.PROMPT_LOOKUP)
    assert c.gain == pytest.approx(free.p(Source.PROMPT_LOOKUP, c.q, c.rank)) and c.gain == pytest.approx(table(c.q, 0))
    assert sources([1]).p(Source.NGRAM, 0.3, 0) == 0.3  # no table: the source's own confidence


def test_nothing_is_proposed_below_the_models_guesses_only_below_the_sources_text():
    free = sources([7, 5, 20, 21, 9, 7, 5])
    t = Tree(free)
    t.add(5, -1, 1.0)
    t.add(30, 0, 0.5)  # the model's guess: the text never had 30 there
    assert [c.parent for c in free.heap] == [0]
    t.add(20, 0, 0.5, source=Source.PROMPT_LOOKUP)  # the text's own continuation
    assert sorted((c.parent, c.token) for c in free.heap) == [(0, 20), (2, 21)]


def test_nothing_is_proposed_below_a_node_that_may_not_grow():
    free = sources([7, 5, 20, 9, 7, 5])
    free.propose(Nodes(tokens=[5], parents=[-1], depth=[0], gain=[1.0]), 0, expandable=False)
    assert free.heap == []


def test_a_forward_reads_the_chain_the_sources_trust_at_no_gain_of_its_own():
    text = [7, 5, *range(100, 100 + 2 * JUMP_TOKENS), 9, 7, 5]
    free = sources(text, {Source.PROMPT_LOOKUP: AcceptanceTable(pooled_prior=0.9)})
    t = Tree(free)
    t.add(5, -1, 1.0)
    end = free.jump(t, 0)
    chain = t.nodes.path(end)
    assert chain == list(range(100, 100 + JUMP_TOKENS))  # the text as it went on, JUMP_TOKENS at most
    assert all(g == 0.0 for g in t.nodes.gain[1:])  # provisional: the model's children confirm them, or none
    distrusted = sources(text, {Source.PROMPT_LOOKUP: AcceptanceTable(pooled_prior=0.01)})
    t2 = Tree(distrusted)
    t2.add(5, -1, 1.0)
    assert distrusted.jump(t2, 0) == 0  # under JUMP_P: no chain
    capped = Tree(sources(text, {Source.PROMPT_LOOKUP: AcceptanceTable(pooled_prior=0.9)}), limit=4)
    capped.add(5, -1, 1.0)
    capped.free.jump(capped, 0)
    assert capped.n_nodes == 4  # the tree's cap
