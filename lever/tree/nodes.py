"""The nodes of one cycle's token tree: parallel arrays, and no policy in them.

TreeBuilder (lever.tree.builder) adds a node when a candidate joins; the growth policies, the
free sources and the lookahead read them. Node 0 is the root, the text's newest token, and
parents come before their children, so a walk in node order meets every parent first. As
llama2.c keeps a forward's buffers in one RunState, this is plain state: lists by node.
"""

from __future__ import annotations

import attrs

from lever.policy.growth import Candidate, Source


@attrs.define
class Nodes:
    """One tree's nodes, by index."""

    tokens: list[int] = attrs.field(factory=list)
    parents: list[int] = attrs.field(factory=list)  # the root's is -1
    depth: list[int] = attrs.field(factory=list)  # the root's is 0
    gain: list[float] = attrs.field(factory=list)  # estimated acceptance: the chance the target's walk reaches it
    q: list[float] = attrs.field(factory=list)  # its proposer's probability of it, given its parent
    rank: list[int] = attrs.field(factory=list)  # its place among its parent's proposals
    source: list[Source] = attrs.field(factory=list)  # who proposed it
    row: list[int] = attrs.field(factory=list)  # its pending row in the draft's cache (-1: the draft never ran it)
    node_of_row: dict[int, int] = attrs.field(factory=dict)
    # node -> (source, q, rank) of each other source that proposed it
    also: dict[int, list[tuple[Source, float, int]]] = attrs.field(factory=dict)
    # (parent, token) -> node: siblings never share a token
    _child: dict[tuple[int, int], int] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, gain: float, q: float = 1.0, rank: int = 0,
            source: Source = Source.MODEL) -> int:
        """A new node below `parent` (-1: the root); its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(0 if parent < 0 else self.depth[parent] + 1)
        self.gain.append(gain)
        self.q.append(q)
        self.rank.append(rank)
        self.source.append(source)
        self.row.append(-1)
        node = len(self.tokens) - 1
        self._child[(parent, token)] = node
        return node

    def child(self, parent: int, token: int) -> int | None:
        """The child of `parent` holding `token`, if it joined."""
        return self._child.get((parent, token))

    def merge(self, c: Candidate) -> int:
        """Another source's proposal of a node already in the tree: the node keeps the better
        estimate (its subtree is priced from it) and notes the other source. Its index."""
        node = self._child[(c.parent, c.token)]
        self.also.setdefault(node, []).append((c.source, c.q, c.rank))
        self.gain[node] = max(self.gain[node], c.gain)
        return node

    def set_row(self, node: int, row: int) -> None:
        self.row[node] = row
        self.node_of_row[row] = node

    def path(self, node: int) -> list[int]:
        """The tokens from below the root down to `node` (the root is the text's last token)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def with_unrun_ancestors(self, nodes: list[int]) -> list[int]:
        """`nodes`, each after those of its ancestors the draft never ran (and no node twice),
        parents first: what one draft forward must run to expand them all."""
        out, seen = [], set()
        for n in nodes:
            chain, a = [], n
            while a >= 0 and self.row[a] < 0 and a not in seen:
                chain.append(a)
                seen.add(a)
                a = self.parents[a]
            out += reversed(chain)
        return out

    def expected_accepted(self) -> float:
        """Tokens the target is expected to accept from the tree: the sum of the gains below the root."""
        return float(sum(self.gain[1:]))
