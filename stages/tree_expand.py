"""TreeExpand: grows each cycle's token tree with the draft, and hands it to verification.

It starts the loop (the prompt is the first tree, prefilled by the target while the draft
prefills too), then after every `Accepted` it roots a new tree at the newest token and grows it
in rounds: the draft expands the nodes added last (one batched forward), their children become
candidates, and the growth policy (lever.policy.growth) picks which join the tree. Lever's picks by
gain/cost: a candidate's gain is its estimated acceptance probability (the product of draft
probabilities along its path, mapped through the acceptance table), its cost the latency it
adds: its share of drafting plus the growth of the verification pass at the new tree size,
from the cost model (a streamed pass pays its flash read once, so while reads dominate, nodes
are nearly free). It adds the best candidate while that raises the tree's expected rate
(accepted tokens + 1 per second of cycle). Fixed shapes (none: autoregressive; chain of k;
k-ary tree) and a confidence bar without a latency model (EdgeLLM-like) are other policies of
the same stage, for the baselines. The free sources (prompt lookup, n-grams: lever.policy.lookup)
propose children at no drafting cost: a draft forward reads their chain below the node it
expands (`TreeBuilder._jump`: text that repeats is drafted a chain per forward, not a token),
and they fill the model's finished tree by the same policy (`TreeBuilder.fill`); the model's
tree is priced by the model's estimates alone.

While the target verifies a tree, the CPU mostly waits on flash; TreeExpand uses that time to
draft ahead (`lookahead_nodes`): it expands the tree's leaves and the best candidates outside
it, since the next cycle's root is one of them (the target's token after the last accepted
node). When the guess holds, the next tree starts from those rows and their children at no
drafting cost, and only the draft's cache rows carry over (the Draft stage keeps them pending).
"""

from __future__ import annotations

import heapq
import time
from typing import Protocol

import anyio
import attrs
import numpy as np

from lever.dataflow.graph import Stage
from lever.dataflow.messages import Accepted, ExpandRequest, Expansion, TokenTree
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.policy.acceptance import AcceptanceTable
from lever.policy.cost_model import CostModel
from lever.policy.growth import POLICIES, Candidate, GrowthPolicy
from lever.policy.lookup import SOURCES, Lookup
from lever.policy.online import OnlineCost, Scales

BAR_WEIGHT = 0.5  # of the newest tree in the moving rate bar
IDLE_PRIOR_CYCLES = 2  # pseudo-cycles at a hit share of one half, before drafting ahead has been seen
FREE_PRIOR = 0.1  # a free source's acceptance before its first trial: pessimistic, one cycle corrects it
JUMP_TOKENS = 16  # free tokens one forward reads ahead below a node it expands
JUMP_P = 0.5  # the least estimated acceptance of each of them
MAX_TREE_SIZE = 1024  # bound on a tree's nodes, depth and fan-out: one pass verifies it, one draft forward expands a round


@attrs.frozen
class TreeExpandConfig:
    """How trees grow. Caps bound every policy; gain-cost usually stops well before them."""

    policy: str = "gain-cost"  # none | chain | kary | confidence (EdgeLLM-like) | gain-cost (Lever)
    max_nodes: int = 64  # nodes per tree, root included: bounds one verification pass
    max_depth: int = 12  # draft tokens on one path
    top_k: int = 4  # children the draft proposes per expanded node
    round_nodes: int = 8  # nodes added per round, expanded together in one draft forward
    chain_length: int = 4  # chain: draft tokens per cycle
    kary_depth: int = 3  # kary: depth of the full tree (top_k children per node)
    confidence: float = 0.3  # confidence: add nodes whose path probability stays above this
    lookahead_nodes: int = 0  # nodes drafted ahead while the target verifies (0: off), within the pass's idle time
    acceptance: str = "online"  # gain-cost: "online" learns draft probability -> acceptance from each cycle; "calibrated" starts from `lever calibrate`'s table and learns on; "identity"
    sources: tuple[str, ...] = ("model",)  # who proposes children: the draft model, "prompt-lookup", "ngram" (lever.policy.lookup); without "model", no draft model runs
    adapt: bool = True  # correct the cost model from each cycle's measured pass, Accept and draft times (lever.policy.online); a seeded sampled run keeps the profile, to stay reproducible

    def __attrs_post_init__(self):
        if self.policy not in POLICIES:  # the names: lever.policy.growth
            raise LeverError(f"[tree_expand] policy: unknown policy {self.policy!r} (known: {', '.join(POLICIES)})")
        for name in ("max_nodes", "max_depth", "top_k", "round_nodes", "chain_length", "kary_depth"):
            if not 1 <= getattr(self, name) <= MAX_TREE_SIZE:
                raise LeverError(f"[tree_expand] {name}: must be in [1, {MAX_TREE_SIZE}], got {getattr(self, name)}")
        if self.acceptance not in ("online", "identity", "calibrated"):
            raise LeverError(f"[tree_expand] acceptance: {self.acceptance!r} is not 'online', 'identity' or 'calibrated'")
        unknown = [x for x in self.sources if x not in SOURCES]
        if not self.sources or unknown or len(set(self.sources)) != len(self.sources):
            raise LeverError(f"[tree_expand] sources: {list(self.sources)} must be distinct names of {', '.join(SOURCES)}")
        if not 0 <= self.lookahead_nodes <= MAX_TREE_SIZE:
            raise LeverError(f"[tree_expand] lookahead_nodes: must be in [0, {MAX_TREE_SIZE}], got {self.lookahead_nodes}")

    @property
    def growth(self) -> GrowthPolicy:
        return POLICIES[self.policy]

    @property
    def uses_model(self) -> bool:
        """Whether trees need the draft model: a drafting policy with "model" among its sources."""
        return self.growth.drafts and "model" in self.sources

    @property
    def lookup_sources(self) -> tuple[str, ...]:
        """The free sources (lever.policy.lookup), for a policy that drafts at all."""
        return tuple(x for x in self.sources if x != "model") if self.growth.drafts else ()

    @property
    def draft_rows(self) -> int:
        """Pending draft rows one cycle may hold: rows carried in, the tree, rows drafted ahead."""
        return self.max_nodes + 2 * self.lookahead_nodes + 1


class Cost(Protocol):
    """What TreeExpand needs from the cost model (lever.policy.cost_model)."""

    def verify_s(self, n_tokens: int) -> float: ...

    def expand_s(self, batch: int) -> float: ...  # one Draft expansion: the forward and the draft's lm_head

    def idle_s(self, n_tokens: int) -> float: ...

    def cycle_s(self, n_tokens: int, draft_s: float, accept_rows: float) -> float: ...  # drafting in turns, pass, Accept

    pass_delay_s: float  # a pass's wait for cores held by drafting ahead


@attrs.frozen
class FlatCost:
    """A cost model of three numbers, for tests and before a profile exists: a pass reads its
    layers once (read_s) while computing n tokens (compute_per_token_s each), whichever is longer."""

    read_s: float = 0.5
    compute_per_token_s: float = 0.01
    draft_step_s: float = 0.02
    pass_delay_s: float = 0.0

    def verify_s(self, n_tokens: int) -> float:
        return max(self.read_s, self.compute_per_token_s * n_tokens)

    def expand_s(self, batch: int) -> float:
        return self.draft_step_s

    def idle_s(self, n_tokens: int) -> float:
        return max(0.0, self.read_s - self.compute_per_token_s * n_tokens)

    def cycle_s(self, n_tokens: int, draft_s: float, accept_rows: float) -> float:
        return draft_s + self.verify_s(n_tokens)


@attrs.define
class TreeBuilder:
    """One cycle's tree, grown round by round from the draft's expansions (no event loop).

    After the tree is sent (`n_sent` nodes), `lookahead_request` keeps growing it past the tree
    into rows drafted ahead; `carry_for` picks, once the target has answered, the part the next
    cycle can start from, and `adopt` hands it to the next cycle's builder.
    """

    config: TreeExpandConfig
    cost: Cost
    cycle: int
    room: int  # nodes the context still has space for
    remaining: int = MAX_TREE_SIZE + 1  # tokens the generation may still emit: a path deeper than remaining - 1 cannot pay
    tokens: list[int] = attrs.field(factory=list)
    parents: list[int] = attrs.field(factory=list)
    depth: list[int] = attrs.field(factory=list)
    gain: list[float] = attrs.field(factory=list)  # estimated acceptance probability of each node
    row: list[int] = attrs.field(factory=list)  # the node's pending row in the draft (-1: not expanded)
    node_of_row: dict[int, int] = attrs.field(factory=dict)
    proposals: dict[int, tuple] = attrs.field(factory=dict)  # pending row -> (child tokens, draft probs, q or None)
    carried: dict[tuple[int, int], int] = attrs.field(factory=dict)  # (parent row, token) -> row drafted ahead
    candidates: list[Candidate] = attrs.field(factory=list)  # a heap, best first
    q_draft: list[float] = attrs.field(factory=list)  # the draft's probability of each node given its parent
    rank: list[int] = attrs.field(factory=list)  # its place among its parent's proposals
    acceptance: AcceptanceTable | None = None  # draft p -> acceptance; None: the identity
    ahead_beside: bool = False  # drafting ahead has cores of its own: it may use the whole pass, not its idle time
    bar_rate: float = 0.0  # tokens/s a node must bring to join (gain-cost): the rate recent trees reached
    idle_value: float = 0.0  # seconds of drafting saved per second of idle compute in the pass (0: no drafting ahead)
    draft_s: float = 0.0  # estimated drafting time of this cycle so far
    n_pending: int = 0  # rows this cycle has added to the draft's cache
    n_sent: int = 0  # nodes in the tree sent to verification; later nodes were drafted ahead
    lookahead_s: float = 0.0  # estimated drafting time spent ahead
    n_ahead: int = 0  # nodes expanded ahead
    n_carried_used: int = 0  # nodes of this tree that came drafted ahead
    sent_s: float = 0.0  # the cycle's predicted time when the tree was sent
    sent_tokens: float = 0.0  # its expected tokens then
    lookup: Lookup | None = None  # the free sources (prompt lookup, n-grams); None: the model's proposals alone
    tables: dict = attrs.field(factory=dict)  # a free source's name -> its acceptance table (None: the identity)
    uses_model: bool = True  # the draft model expands nodes; False: the free sources alone grow the tree
    source: list[str] = attrs.field(factory=list)  # who proposed each node
    _child: dict = attrs.field(factory=dict)  # (parent, token) -> the child node: no two siblings share a token
    also: dict = attrs.field(factory=dict)  # node -> [(source, q, rank)] of the other sources that proposed it too
    _seq: int = 0
    _proposed: set = attrs.field(factory=set)  # nodes the free sources have proposed children of
    _free_children: dict = attrs.field(factory=dict)  # parent node -> the free sources' candidates below it, as proposed
    free: list[Candidate] = attrs.field(factory=list)  # a heap of the free sources' candidates, held until the model's tree is done
    model_rate: float = 0.0  # the model's tree's expected rate before the free sources filled it, tokens/s (0: no fill)

    @property
    def n_nodes(self) -> int:
        return len(self.tokens)

    @property
    def limit(self) -> int:
        """Nodes this tree may reach: the caps, the context, and a chain's fixed length."""
        return self.config.growth.limit(self.config, min(self.config.max_nodes, self.room))

    def add(self, token: int, parent: int, gain: float, q: float = 1.0, rank: int = 0, source: str = "model") -> int:
        self.q_draft.append(q)
        self.rank.append(rank)
        self.source.append(source)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(0 if parent < 0 else self.depth[parent] + 1)
        self.gain.append(gain)
        self.row.append(-1)
        node = self.n_nodes - 1
        self._child[(parent, token)] = node
        if self.lookup is not None:
            self._propose(node)
        return node

    def path(self, node: int) -> list[int]:
        """The tokens from below the root down to `node` (the root is the text's last token)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def _propose(self, node: int) -> None:
        """The free sources' children of the root or of a node one of them proposed (alone or
        with the model): candidates, no forward (held in `free` while the model grows its
        tree). Not under the model's own nodes: a source continues text it predicted, and its
        estimate (learned on the text as it came) says nothing of how it continues text the
        draft made up; trees whose lookup chains hung under the model's guesses expected two
        tokens a pass more than they got."""
        if node in self._proposed or not self._expandable(node):
            return
        # a node a free source proposed too (it joined as theirs, or the model's merged with it)
        if node and all(c.token != self.tokens[node] for c in self._free_children.get(self.parents[node], ())):
            return
        self._proposed.add(node)
        below = self._free_children.setdefault(node, [])
        for source, t, q, rank in self.lookup.propose(self.path(node)):
            c = Candidate(-self.gain[node] * self._free_p(source, q, rank), self._seq, node, int(t), float(q), rank, source)
            heapq.heappush(self.free if self.uses_model else self.candidates, c)
            below.append(c)
            self._seq += 1

    def request(self, nodes: list[int], given: list[int] = (), keep: tuple[int, ...] | None = None,
                carry: tuple[int, ...] = ()) -> ExpandRequest:
        """Ask the draft to expand `nodes` (after extending its cache with `given` tokens); a
        node a free source proposed may hang below others the draft never ran: they run first."""
        nodes = self._with_ancestors(nodes)
        first = self.n_pending
        toks, parents = list(given), [first - 1 + i if i else -1 for i in range(len(given))]
        for i, n in enumerate(nodes):
            row = first + len(given) + i
            self.row[n] = row
            self.node_of_row[row] = n
            p = self.parents[n]
            parents.append(self.row[p] if p >= 0 else first + len(given) - 1)
            toks.append(self.tokens[n])
        self.n_pending += len(toks)
        if toks:
            self.draft_s += self.cost.expand_s(len(toks))
        return ExpandRequest(self.cycle, np.asarray(toks, np.int64), np.asarray(parents, np.int32),
                             self.config.top_k, len(given), keep, carry)

    def forward_tokens(self, nodes: list[int]) -> int:
        return len(self._with_ancestors(nodes))

    def _with_ancestors(self, nodes: list[int]) -> list[int]:
        if self.lookup is None:
            return list(nodes)
        out, seen = [], set()
        for n in nodes:
            chain, a = [], n
            while a >= 0 and self.row[a] < 0 and a not in seen:
                chain.append(a)
                seen.add(a)
                a = self.parents[a]
            out += reversed(chain)
        return out

    def _absorb(self, row: int, toks, probs, q_dist=None) -> None:
        """A node's children from the draft become candidates."""
        self.proposals[row] = (toks, probs, q_dist)
        node = self.node_of_row[row]
        if self.depth[node] + 2 > self.remaining:  # its children would come after the generation's end
            return
        for rank, (t, q) in enumerate(zip(toks, probs)):
            if t < 0:  # fewer tokens had mass than were asked for
                break
            p = self.acceptance(float(q), rank) if self.acceptance is not None else float(q)
            c = Candidate(-self.gain[node] * p, self._seq, node, int(t), float(q), rank)
            if (node, int(t)) in self._child:  # a free source proposed it, and it joined: one node, both estimates
                self._merge(c)
                continue
            heapq.heappush(self.candidates, c)
            self._seq += 1

    def _carried_row(self, parent: int, token: int) -> int | None:
        r = self.row[parent]
        return self.carried.get((r, token)) if r >= 0 else None

    def _expandable(self, n: int) -> bool:
        # a child at depth d, accepted, emits d tokens and the bonus: past the generation's end it is waste
        return self.depth[n] + 2 <= self.remaining and self.config.growth.expandable(self.config, self.depth[n])

    def _absorb_all(self, exp: Expansion) -> None:
        for i, row in enumerate(exp.rows):
            self._absorb(int(row), exp.child_tokens[i], exp.child_probs[i], None if exp.child_q is None else exp.child_q[i])

    def on_expansion(self, exp: Expansion) -> ExpandRequest | None:
        """Take the draft's proposals; pick the next round; None when the tree is done."""
        self._absorb_all(exp)
        return self.next_round()

    def next_round(self, keep: tuple[int, ...] | None = None, carry: tuple[int, ...] = ()) -> ExpandRequest | None:
        """Picks the next nodes; those drafted ahead bring their children at once, the rest
        go to the draft. A cycle's first round always reaches the draft (it carries the rows to keep).
        With no draft model, the free sources' candidates join while they pay, and no request goes out."""
        if not self.uses_model:
            while self.n_nodes < self.limit and self.config.growth.select(self):
                pass
            return None
        expand: list[int] = []
        while True:
            ready = []
            for n in self.config.growth.select(self):
                row = self._carried_row(self.parents[n], self.tokens[n])
                if row is None:
                    expand.append(n)
                    continue
                self.row[n], self.node_of_row[row] = row, n
                self.n_carried_used += 1
                if self._expandable(n):
                    ready.append(n)
            if self.n_nodes >= self.limit:  # full: the children of what was added could not join
                expand = []
                break
            if not ready:
                break
            for n in ready:
                self._absorb(self.row[n], *self.proposals[self.row[n]])
        expand = self.config.growth.expansions(self, [n for n in expand if self._expandable(n)])
        if self.lookup is not None:
            expand = [self._jump(n) for n in expand]
        if expand or keep is not None:
            return self.request(expand, keep=keep, carry=carry)
        return None

    # -- what a growth policy reads and does (lever.policy.growth.Builder)

    def best_candidate(self) -> Candidate | None:
        while self.candidates and (self.candidates[0].parent, self.candidates[0].token) in self._child:
            self._merge(heapq.heappop(self.candidates))  # a sibling with its token joined from another source
        return self.candidates[0] if self.candidates else None

    def _merge(self, c: Candidate) -> None:
        """Another source's proposal of a node already in the tree: the node keeps the better
        estimate (its subtree is priced from it); the model's table learns from it if the model
        proposed it too (the free sources' learn from the text, TreeExpand.learn)."""
        node = self._child[(c.parent, c.token)]
        self.also.setdefault(node, []).append((c.source, c.q, c.rank))
        self.gain[node] = max(self.gain[node], c.gain)
        if c.source != "model":  # a free source's text now runs through it
            self._propose(node)

    def _jump(self, node: int) -> int:
        """The chain the free sources propose below `node`, joined as provisional nodes (no
        gain of their own) for the same forward to run: the node the forward expands instead.

        Text that repeats is drafted one forward per token, though prompt lookup already
        says what comes: a forward runs 16 tokens in about 2.5 times the time of one, so the
        draft reads the chain at once and proposes below every token of it. Where its own
        children hold the chain's next token, the two merge and the chain node gets the
        model's gain, from the model's table; where they do not, that node and the rest of
        the chain keep gain 0 (their children too) and count for nothing in the model's
        pricing: they cost the forward a few tokens and the pass a few nodes."""
        for _ in range(JUMP_TOKENS):
            if self.n_nodes >= self.limit or not self._expandable(node):
                break
            p, best = max(((self._free_p(c.source, c.q, c.rank), c) for c in self._free_children.get(node, ())
                           if (node, c.token) not in self._child), key=lambda x: x[0], default=(0.0, None))
            if best is None or p < JUMP_P:
                break
            node = self.add(best.token, node, 0.0, best.q, best.rank, best.source)
        return node

    def _free_p(self, source: str, q: float, rank: int) -> float:
        """A free proposal's estimated acceptance: its source's table (None: the identity)."""
        table = self.tables.get(source)
        return table(q, rank) if table is not None else q

    def take(self, c: Candidate) -> int:
        """The best candidate, c, joins the tree."""
        assert self.candidates[0] is c
        heapq.heappop(self.candidates)
        return self.add(c.token, c.parent, c.gain, c.q, c.rank, c.source)

    def drop_candidates(self) -> None:
        self.candidates.clear()

    def expected_accepted(self) -> float:
        return float(sum(self.gain[1:]))

    def child_gain(self, node: int) -> float:
        """What the best child of `node` is expected to bring, before the draft proposes it:
        the node's gain times a first child's acceptance (the table's, over the first
        children it saw; with no table, the node's own draft probability). Not the node's
        own acceptance: the draft's doubt is local (a name, a number), the token after one
        is as predictable as any other."""
        if self.acceptance is None:
            return self.gain[node] * self.q_draft[node]
        return self.gain[node] * self.acceptance.first_child()

    def latency_s(self, n_nodes: int | None = None, extra_draft_s: float = 0.0) -> float:
        """The cycle's time by the cost model: drafting in turns so far (and `extra_draft_s`),
        the pass over `n_nodes`, Accept along the expected path."""
        return self.cost.cycle_s(self.n_nodes if n_nodes is None else n_nodes, self.draft_s + extra_draft_s,
                                 self.expected_accepted() + 1)

    def price_s(self, n_nodes: int | None = None, extra_draft_s: float = 0.0) -> float:
        """What growth weighs: the latency, less the pass's idle compute time at what drafting
        ahead makes of it (`idle_value`: the share of cycles that start from rows drafted ahead)."""
        n = self.n_nodes if n_nodes is None else n_nodes
        return self.latency_s(n, extra_draft_s) - self.idle_value * self.cost.idle_s(n)

    def fill(self) -> None:
        """The free sources' candidates join the model's finished tree, by the same policy,
        while they pay for the nodes they add to the pass (they cost no drafting).

        Why after, and not in the same heap: a free node takes nothing from the draft, but
        in one heap it took the model's place in the tree and its forwards (chains hung on
        it were drafted under), and mixed trees accepted fewer tokens a pass than the model's
        alone on text that repeats (7.7 against 9.3). Filled in last, the model's tree is
        priced by the model's estimates alone (its rate bar too: `model_rate`): the free
        sources make its forwards cheaper (`_jump`), never its estimates higher. The free
        nodes add only the width of the pass and the tokens they bring; when one is accepted,
        the draft runs it at the start of the next cycle (as an accepted leaf it never ran)."""
        if not self.uses_model or not self.free:
            return
        self.model_rate = (self.expected_accepted() + 1) / self.latency_s()
        held, self.candidates = self.candidates, self.free  # `_propose` pushes onto self.free: the heap in use
        try:
            while self.n_nodes < self.limit and self.config.growth.select(self):
                pass
        finally:
            self.candidates = held

    def tree(self, pass_id: int, keep: tuple[int, ...]) -> TokenTree:
        self.fill()
        self.n_sent = self.n_nodes
        drafts = {}
        for n, r in enumerate(self.row):
            if r in self.proposals:
                toks, probs, q = self.proposals[r]
                drafts[n] = (toks[toks >= 0], q, np.asarray(probs)[toks >= 0])
        return TokenTree(pass_id, np.asarray(self.tokens, np.int64), np.asarray(self.parents, np.int32), 1,
                         np.asarray(self.gain, np.float32), keep, drafts, self.latency_s())

    # -- drafting ahead, while the target verifies the sent tree

    def lookahead_request(self, time_left_s: float = float("inf")) -> ExpandRequest | None:
        """The next round drafted ahead, or None when the node cap or the pass's idle time is
        used, or when the round would outlast the pass (`time_left_s`, as the cost model expects
        it): a forward still running when the target answers delays the next cycle.

        The next root is the target's token after the last accepted node: a child of a leaf
        or a candidate outside the tree, with probability about its gain. So this expands, by
        gain, the tree's unexpanded nodes and the best candidates, which join as nodes past
        `n_sent`; the next cycle adopts them only when the guess was right."""
        cfg = self.config
        n = min(cfg.round_nodes, cfg.lookahead_nodes - self.n_ahead)
        if n <= 0:
            return None
        # the n likeliest things to expand: unexpanded tree nodes and candidates, by gain
        leaves = [(-self.gain[i], i) for i in range(self.n_sent) if self.row[i] < 0]
        best = heapq.nsmallest(n, leaves + [(c.neg_gain, -1 - k) for k, c in enumerate(heapq.nsmallest(n, self.candidates))])
        # a forward's cost grows slowly with its batch: take the batch with the most gain per second
        gains = np.cumsum([-g for g, _ in best])
        if gains.size == 0:
            return None
        size = 1 + int(np.argmax([gains[b - 1] / self.cost.expand_s(b) for b in range(1, gains.size + 1)]))
        step_s = self.cost.expand_s(size)
        # drafting ahead on the verification's cores: the idle time less what the pass lost
        # waiting for cores held by drafting ahead lately (measured online; 0 from a profile)
        budget_s = self.cost.verify_s(self.n_sent) if self.ahead_beside else \
            self.cost.idle_s(self.n_sent) - self.cost.pass_delay_s
        if self.lookahead_s + step_s > budget_s or step_s > time_left_s:
            return None  # past the time the pass leaves the compute units idle, or past its end
        nodes: list[int] = []
        for _, i in best[:size]:
            if i >= 0:
                nodes.append(i)
            else:  # candidates leave the heap in gain order, as `best` took them
                c = self.best_candidate()
                if c is None:
                    break
                nodes.append(self.take(c))
        self.lookahead_s += self.cost.expand_s(len(nodes))
        self.n_ahead += len(nodes)
        return attrs.evolve(self.request(nodes), ahead=True)

    def on_lookahead(self, exp: Expansion) -> None:
        self._absorb_all(exp)

    def carry_for(self, acc: Accepted) -> tuple[int, ...]:
        """Rows drafted ahead that the next cycle starts from: the new root (the target's token
        after the last accepted node) and its expanded subtree; () when the guess missed."""
        last = acc.keep[-1] if acc.keep else -1
        if last < 0 or self.row[last] < 0:
            return ()
        root = next((i for i in range(self.n_sent, self.n_nodes)
                     if self.parents[i] == last and self.tokens[i] == acc.tokens[-1] and self.row[i] >= 0), None)
        if root is None:
            return ()
        inside = {root}
        for i in range(root + 1, self.n_nodes):  # parents come before children
            if self.parents[i] in inside and self.row[i] >= 0:
                inside.add(i)
        return tuple(sorted(self.row[i] for i in inside))

    def adopt(self, prev: TreeBuilder, carry: tuple[int, ...]) -> None:
        """Takes over rows drafted ahead by `prev` (renumbered from 0, as the draft does);
        the root, node 0, is the first of them."""
        new_row = {old: i for i, old in enumerate(carry)}
        for old, i in new_row.items():
            node = prev.node_of_row[old]
            p = prev.parents[node]
            if i:
                self.carried[(new_row.get(prev.row[p], -1), prev.tokens[node])] = i
            self.proposals[i] = prev.proposals[old]
        self.row[0], self.node_of_row[0] = 0, 0
        self.n_pending = len(carry)
        self._absorb(0, *self.proposals[0])


@attrs.frozen
class CycleRecord:
    """One decoding cycle, as the cost model predicted it and as it went."""

    nodes: int  # the tree's nodes, root included
    predicted_s: float  # drafting in turns, the pass and Accept, by the cost model of that cycle
    predicted_tokens: float  # expected accepted tokens + the bonus token
    measured_s: float  # from the previous Accepted to this one
    tokens: int  # tokens the cycle emitted
    scales: Scales  # the online corrections the tree was priced with


@attrs.frozen
class TreeStats:
    """The trees a run grew."""

    tree_sizes: tuple[int, ...]  # nodes of each speculative tree, root included
    lookahead_hits: int  # cycles that started from rows drafted ahead
    cycles: tuple[CycleRecord, ...] = ()  # every decoding cycle the run finished

    @property
    def mean_nodes(self) -> float:
        return sum(self.tree_sizes) / len(self.tree_sizes) if self.tree_sizes else 1.0

    @property
    def lookahead_hit_share(self) -> float:
        return self.lookahead_hits / len(self.tree_sizes) if self.tree_sizes else 0.0


async def _receive(stream) -> Accepted | None:
    try:
        return await stream.receive()
    except anyio.EndOfStream:
        return None


def prefill_tree(prompt: list[int]) -> TokenTree:
    return TokenTree.chain(0, prompt, n_given=len(prompt), keep=())


@attrs.define
class TreeExpand(Stage):
    """Accepted (+ the draft's Expansions) -> TokenTree for PrunedVerify, starting with the prompt."""

    name: str
    config: TreeExpandConfig
    prompt: list[int]
    cost: Cost = attrs.field(factory=FlatCost)
    n_ctx: int = 4096
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))
    n_predict: int | None = None  # tokens the generation emits at most (Accept stops there); None: no end
    INPUTS = {"accepted": Accepted, "expansion": Expansion}
    OUTPUTS = {"tree": TokenTree, "expand": ExpandRequest}
    OPTIONAL = frozenset({"expansion", "expand"})  # policy none needs no draft

    tree_sizes: list[int] = attrs.field(factory=list)  # nodes of each speculative tree (for the summary)
    lookahead_hits: int = 0  # cycles that started from rows drafted ahead
    acceptance: AcceptanceTable | None = None  # gain-cost with acceptance "online": learned from each cycle
    ahead_beside: bool = False  # drafting ahead runs on cores of its own beside the pass ([runtime] ahead_cores)
    online: OnlineCost | None = None  # the cost model corrected by measurements ([tree_expand] adapt)
    cycles: list[CycleRecord] = attrs.field(factory=list)
    greedy: bool = True  # the free sources propose only under greedy verification (Accept's sampling needs a draft distribution)
    lookup: Lookup | None = None  # the free sources over the text so far ([tree_expand] sources)
    lookup_tables: dict = attrs.field(factory=dict)  # a free source -> its acceptance table, learned from the emitted text
    _committed: int = 0  # target rows committed, to keep trees inside the context
    _emitted: int = 0  # tokens Accept has emitted
    _bar_rate: float = 0.0  # moving estimate of the predicted rate of the trees sent, tokens/s
    _last: TreeBuilder | None = None
    _last_accepted_t: float | None = None  # when the previous Accepted arrived

    def __attrs_post_init__(self):
        if self.acceptance is None and self.config.growth.learns_acceptance and self.config.acceptance == "online":
            self.acceptance = AcceptanceTable()
        if self.online is None and self.config.adapt and isinstance(self.cost, CostModel):
            self.online = OnlineCost(self.cost)
        if self.lookup is None and self.greedy and self.config.lookup_sources:
            self.lookup = Lookup(self.config.lookup_sources)
            self.lookup.extend(self.prompt)
            if self.config.growth.learns_acceptance:
                self.lookup_tables = {x: AcceptanceTable(pooled_prior=FREE_PRIOR) for x in self.config.lookup_sources}

    @property
    def priced_by(self) -> Cost:
        """The cost model the next tree is priced with: the measured corrections applied."""
        return self.online.model if self.online is not None else self.cost

    @property
    def drafting(self) -> bool:
        """Whether the draft model runs (a drafting policy with "model" among its sources)."""
        return self.config.uses_model

    @property
    def speculating(self) -> bool:
        """Whether trees grow at all (from the model, the free sources or both)."""
        return self.drafting or self.lookup is not None

    @property
    def idle_value(self) -> float:
        """What a second of the pass's idle compute is worth: drafting ahead fills it, and saves
        that drafting next cycle when its guess holds (the share of cycles so far, a prior of
        one half before any)."""
        if not self.config.lookahead_nodes or not self.drafting:
            return 0.0
        n = len(self.tree_sizes)
        return (self.lookahead_hits + IDLE_PRIOR_CYCLES / 2) / (n + IDLE_PRIOR_CYCLES)

    def stats(self) -> TreeStats:
        return TreeStats(tuple(self.tree_sizes), self.lookahead_hits, tuple(self.cycles))

    def sent(self, b: TreeBuilder, tree: TokenTree) -> None:
        """A tree goes to verification: its predicted time and tokens, and the rate bar."""
        b.sent_s, b.sent_tokens = tree.cycle_s, b.expected_accepted() + 1
        if b.sent_s > 0:
            rate = b.model_rate or b.sent_tokens / b.sent_s  # the model's trees set the model's bar
            self._bar_rate = rate if not self._bar_rate else BAR_WEIGHT * rate + (1 - BAR_WEIGHT) * self._bar_rate

    def observe(self, acc: Accepted, now_s: float) -> None:
        """What the cycle that `acc` ends measured: into the online estimates and the record."""
        prev = self._last
        if prev is not None and prev.n_sent and self._last_accepted_t is not None and self.speculating:
            measured_s = now_s - self._last_accepted_t
            self.cycles.append(CycleRecord(prev.n_sent, prev.sent_s, prev.sent_tokens, measured_s,
                                           len(acc.tokens), self.online.scales if self.online else Scales()))
            if self.online is not None:
                self.online.observe_cycle(measured_s, prev.sent_s)
        self._last_accepted_t = now_s
        if self.online is not None and acc.timing is not None and acc.pass_id > 0:  # the prefill is not a cycle
            self.online.observe_pass(acc.timing, len(acc.tokens))

    def learn(self, prev: TreeBuilder, acc: Accepted) -> None:
        """The model's table: every sent node whose parent the target reached was a trial,
        accepted or not (unless pruned). The free sources' tables: what they would have
        proposed at each emitted token (`Lookup.trials`), before the text is extended."""
        for source, q, rank, right in self.lookup.trials(acc.tokens) if self.lookup_tables else ():
            self.lookup_tables[source].observe(q, rank, right)
        if self.acceptance is None or prev is None:
            return
        reached, pruned = set(acc.keep), set(acc.pruned)
        for i in range(1, prev.n_sent):
            if prev.parents[i] in reached and i not in pruned:
                for source, q, rank in [(prev.source[i], prev.q_draft[i], prev.rank[i]), *prev.also.get(i, ())]:
                    if source == "model":
                        self.acceptance.observe(q, rank, i in reached)

    def first_request(self) -> ExpandRequest:
        """The draft prefills the prompt while the target does."""
        n = len(self.prompt)
        return ExpandRequest(0, np.asarray(self.prompt, np.int64), np.arange(-1, n - 1, dtype=np.int32),
                             self.config.top_k, n, keep=())

    def start_cycle(self, acc: Accepted) -> tuple[TreeBuilder, ExpandRequest | None]:
        """A new tree rooted at the newest token, and the draft request that starts it."""
        self._committed += len(acc.keep)
        self._emitted += len(acc.tokens)
        self.learn(self._last, acc)
        remaining = MAX_TREE_SIZE + 1 if self.n_predict is None else self.n_predict - self._emitted
        if self.lookup is not None:
            self.lookup.extend(acc.tokens)  # the root, the text's last token, is the newest of them
        b = TreeBuilder(self.config, self.priced_by, acc.pass_id + 1, room=self.n_ctx - self._committed,
                        remaining=remaining, acceptance=self.acceptance, ahead_beside=self.ahead_beside,
                        bar_rate=self._bar_rate, idle_value=self.idle_value, lookup=self.lookup,
                        tables=self.lookup_tables, uses_model=self.drafting)
        b.add(acc.tokens[-1], -1, 1.0)
        if not self.drafting:
            if self.lookup is not None:
                b.next_round()  # the free sources alone: the tree grows here, no draft request
            return b, None
        prev = self._last
        if prev is None:  # after the prefill: the draft holds the whole prompt as pending rows
            return b, b.request([0], [], tuple(range(len(self.prompt))))
        # the accepted path's expanded rows stay; an accepted leaf the draft never ran joins now
        rows = [prev.row[n] for n in acc.keep]
        keep = tuple(r for r in rows if r >= 0)
        given = [prev.tokens[n] for n, r in zip(acc.keep, rows) if r < 0]
        carry = () if given else prev.carry_for(acc)
        if not carry:
            return b, b.request([0], given, keep)
        self.lookahead_hits += 1
        b.adopt(prev, carry)
        return b, b.next_round(keep, carry)

    async def lookahead(self, b: TreeBuilder, expand_out, expansions, accepted) -> Accepted | None:
        """Drafts ahead until the target's answer arrives (or there is nothing worth drafting)."""
        end_s = time.perf_counter() + b.cost.verify_s(b.n_sent)  # when the pass should be done
        while True:
            try:
                return accepted.receive_nowait()
            except anyio.WouldBlock:
                pass
            except anyio.EndOfStream:
                return None
            req = None
            if self.drafting and self.config.lookahead_nodes:
                req = b.lookahead_request(end_s - time.perf_counter())
            if req is None:
                return await _receive(accepted)
            with self.tracer.span(self.name, f"ahead {b.cycle}", kind="other"):
                await expand_out.send(req)
                b.on_lookahead(await expansions.receive())

    async def run(self, inputs, outputs):
        tree_out, expand_out, expansions = outputs["tree"], outputs.get("expand"), inputs.get("expansion")
        accepted = inputs["accepted"]
        await tree_out.send(prefill_tree(self.prompt))
        if self.drafting:
            await expand_out.send(self.first_request())
            await expansions.receive()
        acc = await _receive(accepted)
        while acc is not None:
            self.observe(acc, time.perf_counter())
            if acc.done:
                break
            with self.tracer.span(self.name, f"expand {acc.pass_id + 1}"):
                b, req = self.start_cycle(acc)
                while req is not None:
                    t0 = time.perf_counter()
                    await expand_out.send(req)
                    exp = await expansions.receive()
                    if self.online is not None:  # drafted in turns: the cores were the draft's alone
                        self.online.observe_draft(time.perf_counter() - t0, req.tokens.size)
                    req = b.on_expansion(exp)
            self._last = b
            self.tree_sizes.append(b.n_nodes)
            tree = b.tree(acc.pass_id + 1, acc.keep)
            self.sent(b, tree)
            await tree_out.send(tree)
            acc = await self.lookahead(b, expand_out, expansions, accepted)
