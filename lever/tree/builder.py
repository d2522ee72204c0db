"""TreeBuilder: one cycle's token tree, grown round by round from the draft's expansions.

TreeExpand (stages/tree_expand.py) roots a builder at the newest token and trades requests for
expansions with the Draft stage until `next_round` has nothing left to expand; no event loop
runs here, so tests drive it with a fake draft. Each expansion's children become candidates in
the model's heap, priced by gain (the parent's gain times the child's estimated acceptance:
the draft's probability through the acceptance table); each round the growth policy
(lever.policy.growth) picks which join, and which of the new nodes are worth a draft forward.
The policies see this builder through `Builder`; the tree's other parts are its own:

    nodes      the arrays (lever.tree.nodes)
    free       the free sources' proposals, heap and tables (lever.tree.free), None without any
    ahead      rows carried in from the last tree's drafting ahead (lever.tree.lookahead)
"""

from __future__ import annotations

import heapq

import attrs
import numpy as np

from lever.dataflow.messages import ExpandRequest, Expansion, Proposals, TokenTree
from lever.policy.acceptance import AcceptanceTable
from lever.policy.cost import ALONE, Cost, Others
from lever.policy.growth import Candidate, Source
from lever.tree.config import MAX_TREE_SIZE, TreeExpandConfig
from lever.tree.free import FreeSources
from lever.tree.lookahead import Lookahead
from lever.tree.nodes import Nodes


@attrs.define
class TreeBuilder:
    """One cycle's tree (no event loop). After it is sent (`n_sent` nodes), drafting ahead
    (lever.tree.lookahead) may grow it further, into rows the next tree may start from."""

    config: TreeExpandConfig
    cost: Cost
    cycle: int
    room: int  # nodes the context still has space for
    # tokens the generation may still emit: a path deeper than remaining - 1 cannot pay
    remaining: int = MAX_TREE_SIZE + 1
    acceptance: AcceptanceTable | None = None  # draft p -> acceptance; None: the identity
    bar_rate: float = 0.0  # tokens/s a node must bring to join (gain-cost): the rate recent trees reached
    free: FreeSources | None = None  # the free sources' side (prompt lookup, n-grams); None: the model's alone
    others: Others = ALONE  # the other requests' trees in a pass shared with this one's (lever.pipelines.batcher)
    nodes: Nodes = attrs.field(factory=Nodes)
    ahead: Lookahead = attrs.field(factory=Lookahead)
    heap: list[Candidate] = attrs.field(factory=list)  # the draft model's candidates, best first
    picking: list[Candidate] = attrs.field(init=False)  # the heap the policy picks from now: the model's, then the free
    proposals: dict[int, Proposals] = attrs.field(factory=dict)  # pending row -> the draft's children there
    draft_s: float = 0.0  # estimated drafting time of this cycle so far
    n_pending: int = 0  # rows this cycle has added to the draft's cache
    # the rows of the accepted tokens this cycle's first request gave the draft (leaves it never
    # ran): text before the root, kept with the accepted path when the next cycle commits
    given_rows: tuple[int, ...] = ()
    n_sent: int = 0  # nodes in the tree sent to verification; later nodes were drafted ahead
    # the draft's first choices in this tree: their probabilities' sum and count
    first_qs: list[float] = attrs.field(factory=list)
    _seq: int = 0

    def __attrs_post_init__(self):
        # without the draft model the free sources grow the tree alone, from their own heap
        self.picking = self.heap if self.config.drafts or self.free is None else self.free.heap

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def limit(self) -> int:
        """Nodes this tree may reach: the caps, the context, and a chain's fixed length."""
        return self.config.growth.limit(self.config, min(self.config.max_nodes, self.room))

    def add(self, token: int, parent: int, gain: float, q: float = 1.0, rank: int = 0,
            source: Source = Source.MODEL) -> int:
        node = self.nodes.add(token, parent, gain, q, rank, source)
        if self.free is not None:
            self.free.propose(self.nodes, node, self.expandable(node))
        return node

    def expandable(self, node: int) -> bool:
        # a child at depth d, accepted, emits d tokens and the bonus: past the generation's end it is waste
        d = self.nodes.depth[node]
        return d + 2 <= self.remaining and self.config.growth.expandable(self.config, d)

    def request(self, nodes: list[int], given: list[int] = (), keep: tuple[int, ...] | None = None,
                carry: tuple[int, ...] = ()) -> ExpandRequest:
        """Ask the draft to expand `nodes` (after extending its cache with `given` tokens); a
        node a free source proposed may hang below others the draft never ran: they run first."""
        if self.free is not None:
            nodes = self.nodes.with_unrun_ancestors(nodes)
        first = self.n_pending
        self.given_rows += tuple(range(first, first + len(given)))
        toks, parents = list(given), [first - 1 + i if i else -1 for i in range(len(given))]
        for i, n in enumerate(nodes):
            self.nodes.set_row(n, first + len(given) + i)
            p = self.nodes.parents[n]
            parents.append(self.nodes.row[p] if p >= 0 else first + len(given) - 1)
            toks.append(self.nodes.tokens[n])
        self.n_pending += len(toks)
        if toks:
            self.draft_s += self.cost.expand_s(len(toks))
        return ExpandRequest(self.cycle, np.asarray(toks, np.int64), np.asarray(parents, np.int32),
                             self.config.top_k, len(given), keep, carry)

    def absorb(self, exp: Expansion) -> None:
        """The draft's children of each expanded node become candidates."""
        for i, row in enumerate(exp.rows):
            self.proposals[int(row)] = exp.proposals(i)
            self.absorb_row(int(row))

    def absorb_row(self, row: int) -> None:
        """The children the draft proposed at `row` (in `proposals`) become candidates."""
        prop, node = self.proposals[row], self.nodes.node_of_row[row]
        if self.nodes.depth[node] + 2 > self.remaining:  # its children would come after the generation's end
            return
        for rank, (t, q) in enumerate(zip(prop.tokens, prop.probs)):
            if t < 0:  # fewer tokens had mass than were asked for
                break
            if rank == 0:
                self.first_qs.append(float(q))
            p = self.acceptance(float(q), rank) if self.acceptance is not None else float(q)
            c = Candidate(-self.nodes.gain[node] * p, self._seq, node, int(t), float(q), rank)
            if self.nodes.child(node, int(t)) is not None:  # a free source proposed it, and it joined
                self._merge(c)
                continue
            heapq.heappush(self.heap, c)
            self._seq += 1

    def on_expansion(self, exp: Expansion) -> ExpandRequest | None:
        """Take the draft's proposals; pick the next round; None when the tree is done."""
        self.absorb(exp)
        return self.next_round()

    def next_round(self, keep: tuple[int, ...] | None = None, carry: tuple[int, ...] = ()) -> ExpandRequest | None:
        """Picks the next nodes; those drafted ahead bring their children at once, the rest
        go to the draft. A cycle's first round always reaches the draft (it carries the rows to keep).
        With no draft model, the free sources' candidates join while they pay, and no request goes out."""
        if not self.config.drafts:
            while self.n_nodes < self.limit and self.config.growth.select(self):
                pass
            return None
        expand: list[int] = []
        while True:
            ready = []
            for n in self.config.growth.select(self):
                row = self.ahead.carried_row(self.nodes, self.nodes.parents[n], self.nodes.tokens[n])
                if row is None:
                    expand.append(n)
                    continue
                self.nodes.set_row(n, row)
                self.ahead.n_used += 1
                if self.expandable(n):
                    ready.append(n)
            if self.n_nodes >= self.limit:  # full: the children of what was added could not join
                expand = []
                break
            if not ready:
                break
            for n in ready:
                self.absorb_row(self.nodes.row[n])
        expand = self.config.growth.expansions(self, [n for n in expand if self.expandable(n)])
        if self.free is not None:
            expand = [self.free.jump(self, n) for n in expand]
        if expand or keep is not None:
            return self.request(expand, keep=keep, carry=carry)
        return None

    def tree(self, pass_id: int, keep: tuple[int, ...]) -> TokenTree:
        """The tree to verify, the free sources' fill included; drafting ahead may follow."""
        if self.free is not None and self.config.drafts:
            self.free.fill(self)
        self.n_sent = self.n_nodes
        nodes = self.nodes
        drafts = {n: self.proposals[r].drawn() for n, r in enumerate(nodes.row) if r in self.proposals}
        return TokenTree(pass_id, np.asarray(nodes.tokens, np.int64), np.asarray(nodes.parents, np.int32), n_given=1,
                         gains=np.asarray(nodes.gain, np.float32), q=np.asarray(nodes.q, np.float32), keep=keep,
                         drafts=drafts, cycle_s=self.latency_s())

    # -- what a growth policy reads and does (lever.policy.growth.Builder)

    def best_candidate(self) -> Candidate | None:
        heap = self.picking
        while heap and self.nodes.child(heap[0].parent, heap[0].token) is not None:
            self._merge(heapq.heappop(heap))  # a sibling with its token joined from another source
        return heap[0] if heap else None

    def _merge(self, c: Candidate) -> None:
        """Another source's proposal of a node in the tree (lever.tree.nodes.Nodes.merge); the
        model's table learns from it if the model proposed it too (TreeExpand.learn); a free
        source's text now runs through the node, so the sources propose below it."""
        node = self.nodes.merge(c)
        if c.source != Source.MODEL:
            self.free.propose(self.nodes, node, self.expandable(node))

    def take(self, c: Candidate) -> int:
        """The best candidate, c, joins the tree."""
        assert self.picking[0] is c
        heapq.heappop(self.picking)
        return self.add(c.token, c.parent, c.gain, c.q, c.rank, c.source)

    def drop_candidates(self) -> None:
        self.picking.clear()

    def expected_accepted(self) -> float:
        return self.nodes.expected_accepted()

    def child_gain(self, node: int) -> float:
        """What the best child of `node` is expected to bring, before the draft proposes it:
        the node's gain times a first child's acceptance (the table's, over the first
        children it saw, or before any the prior at this tree's first choices; with no table,
        the node's own draft probability). Not the node's
        own acceptance: the draft's doubt is local (a name, a number), the token after one
        is as predictable as any other."""
        if self.acceptance is None:
            return self.nodes.gain[node] * self.nodes.q[node]
        proposed = sum(self.first_qs) / len(self.first_qs) if self.first_qs else None
        return self.nodes.gain[node] * self.acceptance.first_child(proposed)

    def forward_tokens(self, nodes: list[int]) -> int:
        return len(self.nodes.with_unrun_ancestors(nodes)) if self.free is not None else len(nodes)

    def latency_s(self, n_nodes: int | None = None, extra_draft_s: float = 0.0) -> float:
        """The cycle's time by the cost model: drafting in turns so far (and `extra_draft_s`),
        the pass over `n_nodes`, Accept along the expected path."""
        n = (self.n_nodes if n_nodes is None else n_nodes) + self.others.n_nodes
        return self.cost.cycle_s(n, self.draft_s + extra_draft_s, self.expected_accepted() + 1)

    def price_s(self, n_nodes: int | None = None, extra_draft_s: float = 0.0) -> float:
        """What growth weighs: the latency, less the pass's idle compute time at what drafting
        ahead makes of it (`idle_value`: the share of cycles that start from rows drafted ahead),
        up to what drafting ahead can spend (`usable_s`). So a node's compute costs drafting
        ahead nothing while the pass leaves more idle time than that: at phone scale a 2-4 s
        read leaves seconds, and charging each node its compute at `idle_value` shrank the trees."""
        n = self.n_nodes if n_nodes is None else n_nodes
        idle_s = self.cost.idle_s(n + self.others.n_nodes)
        return self.latency_s(n, extra_draft_s) - self.ahead.idle_value * min(idle_s, self.ahead.usable_s)

