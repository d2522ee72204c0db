"""The fallback: the simple shapes gain-cost's trees must beat, scored off-policy on the same tokens.

Plain autoregressive decoding (the root alone) and chains of every length are points of
gain-cost's search space, so its trees should never emit fewer tokens per second than they
would. A gain the acceptance table has wrong can make them do so, and nothing in the tree says
it. So TreeExpand keeps a `Fallback`. After every cycle it knows, for each emitted token, whether
the draft's first choice at the position before it was that token (the proposals were computed
anyway: lever.policy.acceptance learns from them too). On the last `WINDOW` emitted tokens it
replays each simple shape: a chain of k, verified greedily, emits the run of first choices the
target took, up to k, and the target's own token after it; plain decoding emits one token a
pass. Each replayed cycle is priced by the run's cost model, as gain-cost's own trees were, so
both rates are in the same units on the same text. When the best shape's rate beats what
gain-cost's own recent cycles reached by `MARGIN`, the next `HOLD` cycles grow that shape
(EdgeLLM's fallback, made measurable); then gain-cost grows trees again and the window decides.

A sampled run's acceptance is not a token match: there a chain's tokens per cycle come from the
table's first-child acceptance, the same estimate gain-cost's trees are priced with.
"""

from __future__ import annotations

import collections

import attrs

from lever.policy.growth import Chain, GainCost, NoTree

WINDOW = 96  # emitted tokens a shape is replayed on: a few cycles of any shape, recent enough to follow the text
OWN_CYCLES = 6  # gain-cost's latest cycles its rate is measured over
MARGIN = 0.05  # a shape must beat gain-cost by this share: a tie is not worth leaving the tree for
HOLD = 8  # cycles a shape is kept once chosen, before gain-cost is tried again
MIN_TOKENS = 24  # emitted tokens with a known first choice before any shape is judged


@attrs.frozen
class Shape:
    """What a cycle grows: gain-cost's tree, a chain of `length` draft tokens, or the root alone."""

    policy: str = GainCost.name
    length: int = 0  # a chain's draft tokens

    def __str__(self) -> str:
        return f"chain k={self.length}" if self.policy == Chain.name else self.policy


TREE = Shape()
ROOT = Shape(NoTree.name)


def replay_chain(hits: list[bool], k: int) -> tuple[int, int]:
    """(tokens, cycles) a chain of k draft tokens, verified greedily, emits on `hits` (whether
    the draft's first choice was the target's token, per emitted token in order): each cycle
    takes the run of hits up to k and the target's token after it."""
    i = cycles = 0
    while i < len(hits):
        run = 0
        while run < k and i + run < len(hits) and hits[i + run]:
            run += 1
        i += run + 1
        cycles += 1
    return len(hits), cycles


@attrs.define
class Fallback:
    """The shapes' replayed rates beside gain-cost's own, and which shape the next cycle grows."""

    max_length: int  # the longest chain considered: the tree's depth cap
    greedy: bool = True
    hits: dict[int, bool] = attrs.field(factory=dict)  # emitted token index -> the draft's first choice was it
    own: collections.deque = attrs.field(factory=lambda: collections.deque(maxlen=OWN_CYCLES))  # (tokens, s)
    shape: Shape = TREE
    hold: int = 0  # cycles left in the current shape
    cycles: collections.Counter = attrs.field(factory=collections.Counter)  # shape name -> cycles grown
    switches: int = 0  # times a shape replaced gain-cost's tree
    last_rates: dict[str, float] = attrs.field(factory=dict)  # the latest judgement's tokens/s by shape

    def observe_hit(self, index: int, hit: bool) -> None:
        self.hits[index] = hit
        if len(self.hits) > 4 * WINDOW:  # now and then, not per token: the window is the newest WINDOW
            self.hits = {i: h for i, h in self.hits.items() if i >= index - 2 * WINDOW}

    def observe_cycle(self, shape: Shape, tokens: int, predicted_s: float) -> None:
        self.cycles[str(shape)] += 1
        if shape == TREE and predicted_s > 0:
            self.own.append((tokens, predicted_s))

    def rates(self, cost, first_child: float) -> dict[Shape, float]:
        """Tokens per second of each simple shape replayed on the window, by `cost` (the Cost
        protocol, lever.policy.cost); `first_child`: the table's estimate, for sampling."""
        recent = sorted(self.hits)[-WINDOW:]
        hits = [self.hits[i] for i in recent]
        out = {ROOT: 1.0 / cost.cycle_s(1, 0.0, 1.0)}
        for k in range(1, self.max_length + 1):
            if self.greedy:
                tokens, cycles = replay_chain(hits, k)
                per_cycle = tokens / max(cycles, 1)
            else:  # expected tokens of a chain whose nodes are each taken with the first-child rate
                per_cycle = 1.0 + sum(first_child ** d for d in range(1, k + 1))
            out[Shape(Chain.name, k)] = per_cycle / cost.cycle_s(k + 1, k * cost.expand_s(1), per_cycle)
        return out

    def choose(self, cost, first_child: float) -> Shape:
        """The shape of the next cycle."""
        if self.hold > 0:
            self.hold -= 1
            return self.shape
        self.shape = TREE
        if len(self.own) < self.own.maxlen or len(self.hits) < MIN_TOKENS:
            return TREE
        own_rate = sum(t for t, _ in self.own) / sum(s for _, s in self.own)
        rates = self.rates(cost, first_child)
        best = max(rates, key=rates.get)
        self.last_rates = {str(k): v for k, v in rates.items()} | {str(TREE): own_rate}
        if rates[best] > own_rate * (1 + MARGIN):
            self.shape, self.hold = best, HOLD - 1
            self.switches += 1
            self.own.clear()  # gain-cost is judged afresh when it comes back
        return self.shape
