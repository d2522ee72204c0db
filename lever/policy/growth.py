"""Tree-growth policies: which of the draft's candidates join a cycle's token tree.

TreeExpand's builder (lever.tree.builder) keeps the tree and a heap of candidates (children
the draft proposed, by estimated acceptance); each round it asks its policy which candidates
join, and whether a node is worth a draft forward of its own. The policies are the paper's
baselines and Lever's own:

    none        autoregressive: the root alone, no draft (Flash-AR)
    chain       the best child of the last node, k deep (Chain-SD)
    kary        every candidate down to a fixed depth (a static tree)
    confidence  candidates whose path probability stays above a bar, no latency model
                (EdgeLLM-like; it verifies with the full output head, as EdgeLLM does)
    gain-cost   the best candidate while it raises the tree's expected accepted tokens per
                second of cycle, from the cost model (Lever)

A policy is chosen once from `[tree_expand] policy` (`POLICIES[name]`); nothing else tests the
name. The builder is reached through the small `Builder` protocol, so policies import no stage.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Protocol

import attrs

from lever.policy.cost import Cost, Others


class Source(enum.StrEnum):
    """Who proposes a child: the draft model, or a free source (lever.policy.lookup). The
    values are `[tree_expand] sources`' names."""

    MODEL = "model"
    PROMPT_LOOKUP = "prompt-lookup"
    NGRAM = "ngram"


@attrs.frozen(order=True)
class Candidate:
    """A child the draft proposed, waiting to join the tree. Ordered for the builder's heap:
    highest gain first, ties in the order they were proposed."""

    neg_gain: float  # minus its estimated acceptance (heapq pops the smallest)
    seq: int
    parent: int = attrs.field(order=False)  # its parent node in the tree
    token: int = attrs.field(order=False)
    q: float = attrs.field(order=False)  # the draft's probability of it, given its parent
    rank: int = attrs.field(order=False)  # its place among its parent's proposals
    source: Source = attrs.field(default=Source.MODEL, order=False)  # who proposed it

    @property
    def gain(self) -> float:
        return -self.neg_gain


class GrowthConfig(Protocol):
    """What the policies read of [tree_expand] (lever.tree.config.TreeExpandConfig, on the floor
    above: a policy is chosen by its name there)."""

    max_depth: int  # draft tokens on one path
    round_nodes: int  # nodes added per round
    chain_length: int  # chain: draft tokens per cycle
    kary_depth: int  # kary: the full tree's depth
    confidence: float  # confidence: the path probability a node keeps above


class Builder(Protocol):
    """What a policy reads and does on a tree under construction (lever.tree.builder.TreeBuilder)."""

    config: GrowthConfig
    cost: Cost
    nodes: object  # lever.tree.nodes.Nodes (the floor above): the arrays (gain, depth, ...) by node
    bar_rate: float  # tokens/s a node must bring: what the last trees reached (0: none yet)
    others: Others  # the other requests' trees in a pass shared with this one (lever.pipelines.batcher)

    @property
    def n_nodes(self) -> int: ...

    @property
    def limit(self) -> int: ...

    def best_candidate(self) -> Candidate | None: ...

    def take(self, c: Candidate) -> int: ...  # pops c (the best) into the tree; its node

    def drop_candidates(self) -> None: ...

    def expected_accepted(self) -> float: ...


    def child_gain(self, node: int) -> float: ...  # the expected gain of node's best child, before drafting it

    def latency_s(self, n_nodes: int | None = None, extra_draft_s: float = 0.0) -> float: ...

    # the latency less what the pass's idle time is worth
    def price_s(self, n_nodes: int | None = None, extra_draft_s: float = 0.0) -> float: ...

    def forward_tokens(self, nodes: list[int]) -> int: ...  # tokens a draft forward expanding `nodes` runs


class GrowthPolicy:
    """The default answers are a policy that drafts nothing."""

    name: ClassVar[str]
    speculates: ClassVar[bool] = True  # grows trees past the root
    full_lm_head: ClassVar[bool] = False  # Accept runs the output head over the whole tree
    learns_acceptance: ClassVar[bool] = False  # gains go through the acceptance table, learned online

    def limit(self, config: GrowthConfig, cap: int) -> int:
        """Nodes a tree may reach, given the caps and the context (`cap`)."""
        return cap

    def select(self, b: Builder) -> list[int]:
        """The nodes that join this round (added to the tree by `b.take`)."""
        return []

    def expandable(self, config: GrowthConfig, depth: int) -> bool:
        """Whether a node at `depth` may have children."""
        return depth < config.max_depth

    def expansions(self, b: Builder, nodes: list[int]) -> list[int]:
        """Which of the round's new nodes get a draft forward for their children."""
        return nodes


def take_best(b: Builder, n: int, bar: float = float("-inf")) -> list[int]:
    """Up to n best candidates, while the tree has room and their gain is at least `bar`."""
    added = []
    while len(added) < n and b.n_nodes < b.limit:
        c = b.best_candidate()
        if c is None or c.gain < bar:
            break
        added.append(b.take(c))
    return added


class NoTree(GrowthPolicy):
    name = "none"
    speculates = False


class Chain(GrowthPolicy):
    name = "chain"

    def limit(self, config, cap: int) -> int:
        return min(cap, config.chain_length + 1)

    def select(self, b: Builder) -> list[int]:
        added = take_best(b, 1)
        b.drop_candidates()  # a chain keeps only the best child of its last node
        return added


class Kary(GrowthPolicy):
    name = "kary"

    def select(self, b: Builder) -> list[int]:
        return take_best(b, b.limit)

    def expandable(self, config, depth: int) -> bool:
        return depth < min(config.max_depth, config.kary_depth)


class Confidence(GrowthPolicy):
    name = "confidence"
    full_lm_head = True

    def select(self, b: Builder) -> list[int]:
        return take_best(b, b.config.round_nodes, bar=b.config.confidence)


class GainCost(GrowthPolicy):
    name = "gain-cost"
    learns_acceptance = True

    def select(self, b: Builder) -> list[int]:
        """Adds the best candidates while each raises (E + 1) / latency, by at least the rate
        the trees reach (`b.bar_rate`).

        A candidate's token is known (its parent's expansion proposed it), so joining costs
        only its share of the pass and of Accept; the draft forward it may take later buys its
        children, and `expansions` weighs it against them.

        Why the bar: early in a tree the rate is low (the pass is paid, few tokens expected
        yet), so a sibling of gain 0.05 looks worth a few ms; once the backbone is in, it is
        not, but it has joined. The optimal tree's marginal gain per second equals its own
        rate, so a node must bring at least the rate the last trees reached (the threshold
        of a fractional knapsack), not only the current one."""
        added = []
        while len(added) < b.config.round_nodes and b.n_nodes < b.limit:
            c = b.best_candidate()
            if c is None or not pays(b, c.gain, b.price_s(), b.price_s(b.n_nodes + 1)):
                break
            added.append(b.take(c))
        return added

    def expansions(self, b: Builder, nodes: list[int]) -> list[int]:
        """The nodes worth one batched draft forward: by gain, each while its best child's
        expected gain (`b.child_gain`) pays for what the node adds to the forward and for the
        child's share of the pass. A forward costs nearly the same for 1 token as for 8, so
        the first node pays the whole forward and the others ride along."""
        chosen: list[int] = []
        before = b.price_s()  # each price walks every layer: the last one accepted is the next one's start
        for n in sorted(nodes, key=lambda n: -b.nodes.gain[n]):
            k = len(chosen) + 1
            # the forward runs the node's ancestors a free source proposed and the draft never ran
            after = b.price_s(b.n_nodes + k, b.cost.expand_s(b.forward_tokens([*chosen, n])))
            if not pays(b, b.child_gain(n), before, after):
                break
            chosen.append(n)
            before = after
        return chosen


def pays(b: Builder, gain: float, before_s: float, after_s: float) -> bool:
    """Whether `gain` more expected tokens for a cycle of `after_s` instead of `before_s`
    raises the pass's rate (this tree's tokens and, in a shared pass, the others') and brings
    at least `b.bar_rate` tokens per second it adds."""
    e = b.expected_accepted() + 1 + b.others.tokens
    if (e + gain) / after_s < e / before_s:
        return False
    return after_s <= before_s or gain / (after_s - before_s) >= b.bar_rate


POLICIES: dict[str, GrowthPolicy] = {p.name: p for p in (NoTree(), Chain(), Kary(), Confidence(), GainCost())}
