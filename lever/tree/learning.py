"""What a run learns from its cycles, for the trees that follow.

Beside lever.tree.cycle, which asks it after every Accepted: the draft's acceptance table (the
gains of gain-cost, and every policy's score), from the nodes the target reached (`learn`, and
`learn_given` for an accepted leaf the draft never ran); the free sources' tables, from every
emitted token; the cost model's corrections, from what each cycle measured (`observe`,
lever.policy.online); the fallback's replay of simpler shapes (lever.policy.fallback); the rate
bar the next tree must reach. No event loop: tests drive it with Accepted messages.
"""

from __future__ import annotations

import attrs

from lever.dataflow.messages import Accepted, ExpandRequest, Expansion, TokenTree
from lever.policy.acceptance import MODEL_PRIOR_WEIGHT, AcceptanceTable
from lever.policy.cost import Cost
from lever.policy.cost_model import CostModel
from lever.policy.fallback import TREE, Fallback, Shape
from lever.policy.growth import Source
from lever.policy.lookup import Lookup
from lever.policy.online import OnlineCost, Scales
from lever.tree.builder import TreeBuilder
from lever.tree.config import TreeExpandConfig
from lever.tree.free import FREE_PRIOR

BAR_WEIGHT = 0.5  # of the newest tree in the moving rate bar


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
class SentTree:
    """A tree as it went to verification: what the cost model predicted of its cycle."""

    nodes: int  # nodes sent, root included
    predicted_s: float  # the cycle's predicted time
    predicted_tokens: float  # its expected tokens (accepted + the bonus token), as the policy priced them
    scored_tokens: float  # its expected tokens by the run's acceptance table, whatever the policy priced with


@attrs.define
class TreeLearner:
    """A run's learned state; `for_run` makes the parts its config and sampling ask for."""

    config: TreeExpandConfig
    cost: Cost
    greedy: bool = True  # free sources propose only under greedy verification (sampling needs a draft distribution)
    # the draft's acceptance, learned from each cycle: gain-cost's gains go through it (unless
    # [tree_expand] acceptance = "identity"), and every policy's trees are scored by it
    acceptance: AcceptanceTable | None = None
    online: OnlineCost | None = None  # the cost model corrected by measurements ([tree_expand] adapt)
    lookup: Lookup | None = None  # the free sources over the text so far ([tree_expand] sources)
    lookup_tables: dict = attrs.field(factory=dict)  # a free source -> its acceptance table, learned from the text
    fallback: Fallback | None = None  # gain-cost's check against the shapes it contains ([tree_expand] fallback)
    cycles: list[CycleRecord] = attrs.field(factory=list)
    bar_rate: float = 0.0  # moving estimate of the predicted rate of the trees sent, tokens/s
    last_accepted_s: float | None = None  # when the previous Accepted arrived

    @classmethod
    def for_run(cls, config: TreeExpandConfig, cost: Cost, prompt: list[int], *, greedy: bool = True,
                acceptance: AcceptanceTable | None = None) -> TreeLearner:
        """The tables, corrections and fallback `config` asks for; `acceptance`: a starting table
        (`lever calibrate`'s), else a fresh one when the draft runs."""
        if acceptance is None and config.drafts:
            acceptance = AcceptanceTable(prior_weight=MODEL_PRIOR_WEIGHT, shaped=greedy)
        fallback = Fallback(config.max_depth, greedy=greedy) if config.fallback and config.drafts and \
            config.growth.learns_acceptance else None
        online = OnlineCost(cost) if config.adapt and isinstance(cost, CostModel) else None
        lookup, tables = None, {}
        if greedy and config.lookup_sources:
            lookup = Lookup(config.lookup_sources)
            lookup.extend(prompt)
            if config.growth.learns_acceptance:
                tables = {x: AcceptanceTable(pooled_prior=FREE_PRIOR) for x in config.lookup_sources}
        return cls(config=config, cost=cost, greedy=greedy, acceptance=acceptance, online=online, lookup=lookup,
                   lookup_tables=tables, fallback=fallback)

    def reprice(self, layer_read_bytes: tuple[int, ...]) -> None:
        """Each layer's reads per pass from the next tree on: a live memory budget moved the
        resident layers (lever.pipelines.residency); what was learned of the read rate holds. A
        run priced by the profile alone (no `adapt`: a seeded sampled run, whose draws follow its
        trees) keeps its prices, so its draws are those of a run the budget left alone."""
        if isinstance(self.cost, CostModel) and self.config.adapt:
            self.cost = attrs.evolve(self.cost, layer_read_bytes=layer_read_bytes)
            if self.online is not None:
                self.online.base = self.cost
                self.online._model = None

    @property
    def prices_by_table(self) -> bool:
        """Whether the growth policy's gains go through the acceptance table (gain-cost)."""
        return self.config.growth.learns_acceptance and self.config.acceptance != "identity"

    @property
    def priced_by(self) -> Cost:
        """The cost model the next tree is priced with: the measured corrections applied."""
        return self.online.model if self.online is not None else self.cost

    @property
    def speculates(self) -> bool:
        """Whether trees grow in this run: the draft model's, or the free sources' (greedy only)."""
        return self.config.drafts or self.lookup is not None

    def shape(self) -> Shape:
        """What the next tree grows as: gain-cost's tree, or the fallback's simpler shape."""
        return self.fallback.choose(self.priced_by, self.acceptance.first_child()) if self.fallback else TREE

    def sent(self, b: TreeBuilder, tree: TokenTree, shape: Shape) -> SentTree:
        """A tree goes to verification: its predicted time and tokens, and the rate bar."""
        n, tokens = b.nodes, b.expected_accepted() + 1
        scored = tokens if self.acceptance is None else 1 + self.acceptance.score(
            n.parents, n.q, n.rank, n.gain, [x == Source.MODEL for x in n.source])
        if tree.cycle_s > 0 and shape == TREE:  # the bar is the trees' own, not a fallback shape's
            filled = b.free.model_rate if b.free is not None else 0.0  # the model's trees set the model's bar
            rate = filled or tokens / tree.cycle_s
            self.bar_rate = rate if not self.bar_rate else BAR_WEIGHT * rate + (1 - BAR_WEIGHT) * self.bar_rate
        return SentTree(b.n_sent, tree.cycle_s, tokens, scored)

    def observe(self, acc: Accepted, prev: SentTree | None, shape: Shape, now_s: float) -> None:
        """What the cycle that `acc` ends (the tree `prev` sent, grown as `shape`) measured: into
        the online estimates and the record."""
        if prev is not None and prev.nodes and self.last_accepted_s is not None and self.speculates:
            measured_s = now_s - self.last_accepted_s
            self.cycles.append(CycleRecord(prev.nodes, prev.predicted_s, prev.scored_tokens, measured_s,
                                           len(acc.tokens), self.online.scales if self.online else Scales()))
            if self.online is not None:
                self.online.observe_cycle(measured_s, prev.predicted_s)
            if self.fallback is not None:
                self.fallback.observe_cycle(shape, len(acc.tokens), prev.predicted_s)
        self.last_accepted_s = now_s
        if self.online is not None and acc.timing is not None and acc.pass_id > 0:  # the prefill is not a cycle
            self.online.observe_pass(acc.timing, len(acc.tokens))

    def learn(self, prev: TreeBuilder | None, acc: Accepted, first: int) -> None:
        """The model's table, greedy: at every emitted token whose parent the draft expanded,
        each of the draft's proposals there was a trial, whatever tree was grown (off-policy;
        an accepted leaf the draft never ran is seen in the next cycle's first expansion,
        `learn_given`). Sampled: every sent node whose parent the target reached was a trial,
        accepted or not (unless pruned). The free sources' tables: what they would have
        proposed at each emitted token (`Lookup.trials`), before the text is extended.
        `first`: the index of the cycle's first emitted token in the generation."""
        for source, q, rank, right in self.lookup.trials(acc.tokens) if self.lookup_tables else ():
            self.lookup_tables[source].observe(q, rank, right)
        if self.acceptance is None or prev is None:
            return
        if self.greedy:
            for j, (parent, token) in enumerate(zip(acc.keep, acc.tokens)):  # keep: the root, then the path
                row = prev.nodes.row[parent]
                if row in prev.proposals:
                    prop = prev.proposals[row]
                    self.observe_proposals(first + j, prop.tokens, prop.probs, token)
            return
        reached, pruned, nodes = set(acc.keep), set(acc.pruned), prev.nodes
        for i in range(1, prev.n_sent):
            if nodes.parents[i] in reached and i not in pruned:
                for source, q, rank in [(nodes.source[i], nodes.q[i], nodes.rank[i]), *nodes.also.get(i, ())]:
                    if source == Source.MODEL:
                        self.acceptance.observe(q, rank, i in reached)

    def learn_given(self, req: ExpandRequest, exp: Expansion, root: int, first: int) -> None:
        """The draft's proposals at the accepted leaves it never ran (the cycle's given
        tokens): each given token's next is the following one, the last one's the root.
        `first`: the index in the generation of the first given token's next."""
        if exp.given is None or self.acceptance is None:
            return
        given = [int(t) for t in req.tokens[: req.n_given]]
        for j, ((tokens, probs), nxt) in enumerate(zip(zip(*exp.given), [*given[1:], root])):
            self.observe_proposals(first + j, tokens, probs, nxt)

    def observe_proposals(self, index: int, tokens, probs, target: int) -> None:
        """The draft's proposals before the emitted token `index`, which was `target`."""
        self.acceptance.observe_proposals(tokens, probs, target)
        if self.fallback is not None and len(tokens):
            self.fallback.observe_hit(index, int(tokens[0]) == target)

    def observe_draft(self, seconds: float, n_tokens: int) -> None:
        """A forward drafted in turns (the cores were the draft's alone), for the corrections."""
        if self.online is not None:
            self.online.observe_draft(seconds, n_tokens)
