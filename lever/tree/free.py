"""The free sources' side of a cycle's tree: what prompt lookup and the n-gram cache propose.

The sources themselves (lever.policy.lookup) read the text; this is what the tree does with
their proposals. They propose children of the root and of nodes they proposed, at no drafting
cost, into a heap of their own, held while the draft model grows its tree from the model's
heap: the model's tree is priced by the model's estimates alone. Two things then use them:

- `jump`: a draft forward that expands a node reads their chain below it too, so text that
  repeats is drafted a chain per forward instead of a token per forward;
- `fill`: once the model's tree is done, their candidates join it by the same growth policy,
  while they pay for the width they add to the pass (they cost no drafting).

Why a heap of their own: in one heap with the model's, a free node took the model's place in
the tree and its forwards (chains hung on it were drafted under), and mixed trees accepted
fewer tokens a pass than the model's alone on text that repeats (docs/measurements.md,
'Free sources in the model's heap').
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Protocol

import attrs

from lever.policy.acceptance import AcceptanceTable
from lever.policy.growth import Candidate, Source
from lever.policy.lookup import Lookup
from lever.tree.config import TreeExpandConfig
from lever.tree.nodes import Nodes

FREE_PRIOR = 0.1  # a free source's acceptance before its first trial: pessimistic, one cycle corrects it
JUMP_TOKENS = 16  # free tokens one forward reads ahead below a node it expands
JUMP_P = 0.5  # the least estimated acceptance of each of them


class Growing(Protocol):
    """What the free sources need of the tree being built (lever.tree.builder.TreeBuilder)."""

    nodes: Nodes
    picking: list[Candidate]  # the heap the growth policy picks from
    config: TreeExpandConfig

    @property
    def n_nodes(self) -> int: ...

    @property
    def limit(self) -> int: ...

    def add(self, token: int, parent: int, gain: float, q: float = 1.0, rank: int = 0,
            source: Source = Source.MODEL) -> int: ...

    def expandable(self, node: int) -> bool: ...

    def expected_accepted(self) -> float: ...

    def latency_s(self) -> float: ...


@attrs.define
class FreeSources:
    """One cycle's free proposals: the sources and their tables are the run's (TreeExpand
    keeps them across cycles); the heap and what was proposed where are this tree's."""

    lookup: Lookup
    tables: dict[Source, AcceptanceTable | None] = attrs.field(factory=dict)  # None or missing: the identity
    # under a grammar: the tokens it allows after a path below the root (lever.model.grammar);
    # a source's proposal it refuses never joins, as the draft's children are masked
    allowed: Callable[[list[int]], object] | None = None
    heap: list[Candidate] = attrs.field(factory=list)  # best first
    _seq: int = 0
    _proposed: set[int] = attrs.field(factory=set)  # nodes whose children the sources have proposed
    _below: dict[int, list[Candidate]] = attrs.field(factory=dict)  # node -> the candidates proposed below it
    model_rate: float = 0.0  # the model's tree's expected rate before the sources filled it, tokens/s (0: no fill)

    def p(self, source: Source, q: float, rank: int) -> float:
        """A free proposal's estimated acceptance, by its source's table."""
        table = self.tables.get(source)
        return table(q, rank) if table is not None else q

    def propose(self, nodes, node: int, expandable: bool) -> None:
        """The sources' children of the root or of a node one of them proposed (alone or with
        the model) join the heap. Not under the model's own nodes: a source continues text it
        predicted, and its estimate (learned on the text as it came) says nothing of how it
        continues text the draft made up; trees whose lookup chains hung under the model's
        guesses expected more tokens a pass than they got (docs/measurements.md,
        'Free sources under the model's nodes')."""
        if node in self._proposed or not expandable:
            return
        if node and all(c.token != nodes.tokens[node] for c in self._below.get(nodes.parents[node], ())):
            return  # the model's node, and no source proposed its token
        self._proposed.add(node)
        below = self._below.setdefault(node, [])
        path = nodes.path(node)
        proposed = self.lookup.propose(path)
        mask = self.allowed(path) if self.allowed is not None and proposed else None
        for source, t, q, rank in proposed:
            if mask is not None and not mask[t]:
                continue
            c = Candidate(-nodes.gain[node] * self.p(source, q, rank), self._seq, node, int(t), float(q), rank, source)
            heapq.heappush(self.heap, c)
            below.append(c)
            self._seq += 1

    def jump(self, b: Growing, node: int) -> int:
        """The chain the sources propose below `node`, joined as provisional nodes (no gain of
        their own) for the same forward to run: the node the forward expands instead.

        A forward over a chain of tokens costs a small multiple of a forward over one
        (docs/measurements.md, 'Draft forward cost by batch'), so where prompt lookup
        already says what comes, the draft reads the chain at once and proposes below every
        token of it. Where its own children hold the chain's next token, the two merge and the
        chain node gets the model's gain; where they do not, that node and the rest of the
        chain keep gain 0 (their children too) and count for nothing in the model's pricing:
        they cost the forward a few tokens and the pass a few nodes."""
        for _ in range(JUMP_TOKENS):
            if b.n_nodes >= b.limit or not b.expandable(node):
                break
            p, best = max(((self.p(c.source, c.q, c.rank), c) for c in self._below.get(node, ())
                           if b.nodes.child(node, c.token) is None), key=lambda x: x[0], default=(0.0, None))
            if best is None or p < JUMP_P:
                break
            node = b.add(best.token, node, 0.0, best.q, best.rank, best.source)
        return node

    def fill(self, b: Growing) -> None:
        """The sources' candidates join the model's finished tree by the same policy, while
        they pay for the nodes they add to the pass. The model's tree sets the rate bar
        (`model_rate`): the sources make its forwards cheaper (`jump`), never its estimates
        higher. An accepted free node the draft never ran is run at the next cycle's start."""
        if not self.heap:
            return
        self.model_rate = (b.expected_accepted() + 1) / b.latency_s()
        b.picking = self.heap  # the model's tree is done: the policy picks from the sources' heap from now on
        while b.n_nodes < b.limit and b.config.growth.select(b):
            pass
