"""The acceptance table TreeExpand's gains go through: draft probability -> acceptance.

A node's gain is the chance the target accepts it, which the draft's own probability only
approximates: under greedy verification the draft's first choice is accepted more often than
its probability says, its later choices far less. The table keeps, per rank (first child or
not) and probability bin, how often the target accepted such nodes whenever it reached their
parent. It starts as the identity (each cell holds `prior_weight` pseudo-observations at the
node's own probability) and learns online, so a run calibrates itself within a few cycles;
`lever calibrate` fits it offline on a corpus, and `[tree_expand] acceptance = "calibrated"`
starts from that table.

What it learns from, under greedy verification, is every emitted token, whatever tree was
grown (`observe_proposals`): the draft's proposals at the position before it were computed
anyway (its parent was expanded), and each of them is a trial whose outcome is known, the
target's token. Learning only from the nodes a policy put in its trees (on-policy) sees a
biased sample: a sibling joins when its estimate is high, so the cells of those it tried
stayed optimistic, and cells it stopped trying were never corrected (docs/measurements.md,
'Acceptance off-policy'). Sampled runs learn on-policy: a drawn child's acceptance depends on
the target's distribution there, not on its token alone.

A free source (lever.policy.lookup) has a table too, but its `q` is a confidence, not a
probability: the identity would take an n-gram seen twice for a two-in-three chance, and on
text that does not repeat such nodes are rarely accepted. So its cells start from the source's
pooled acceptance instead (`pooled_prior`): every trial of the source, in any cell, moves the
prior of all of them, starting from a pessimistic guess that one or two cycles correct either
way (on text that repeats, long matches are accepted most of the time). The rates:
docs/measurements.md, 'Free-source acceptance'.
"""

from __future__ import annotations

import attrs
import numpy as np

# the draft model's table learns off-policy, from every proposal at every emitted token (top_k
# trials a token): one pseudo-observation at the prior is enough, where more held the cells of a
# draft's first choices near their probability, below what the target takes
# (docs/measurements.md, 'Acceptance off-policy')
MODEL_PRIOR_WEIGHT = 1.0
# greedy verification takes a draft's first choice more often than its probability says and its
# later choices less: a shaped prior (first choice sqrt(q), the others q^1.5, fitted by eye on the
# Qwen pair's code prompts) is nearer both from the first cycle, when deep paths were priced
# below what they kept (same section)
FIRST_EXPONENT, LATER_EXPONENT = 0.5, 1.5
# a shaped cell's prior weighs at least one expected acceptance (1 / prior observations, up to
# this): a later choice of q 0.05 is taken about 1% of the time, and one lucky hit in its first
# two trials read 0.34 at one pseudo-observation, so wide trees of such siblings grew until the
# cell had seen dozens (docs/measurements.md, 'The first tree')
MAX_PRIOR_WEIGHT = 20.0


@attrs.define
class AcceptanceTable:
    n_bins: int = 10
    prior_weight: float = 4.0  # pseudo-observations at the identity, per cell
    # a free source's: cells start at its pooled acceptance, this before any trial (None: the identity)
    pooled_prior: float | None = None
    pooled_weight: float = 1.0  # pseudo-observations at `pooled_prior`: a guess, so the first trials overrule it
    shaped: bool = False  # the prior is q^FIRST_EXPONENT for a first choice, q^LATER_EXPONENT after (greedy)
    accepted: np.ndarray = attrs.field(init=False)  # (2, n_bins): first child, other children
    trials: np.ndarray = attrs.field(init=False)
    first_prior: np.ndarray = attrs.field(init=False)  # (n_bins,): a first choice's prior at each bin's centre

    def __attrs_post_init__(self):
        self.accepted = np.zeros((2, self.n_bins))
        self.trials = np.zeros((2, self.n_bins))
        self.first_prior = np.array([self.prior((b + 0.5) / self.n_bins, 0) for b in range(self.n_bins)])

    def _cell(self, q: float, rank: int) -> tuple[int, int]:
        return min(rank, 1), min(int(q * self.n_bins), self.n_bins - 1)

    def __call__(self, q: float, rank: int) -> float:
        """Estimated acceptance of a node the draft gave probability q as its rank-th child."""
        r, b = self._cell(q, rank)
        prior = self.prior(q, rank) if self.pooled_prior is None else self.pooled()
        w = self.prior_weight
        if self.shaped and self.pooled_prior is None:
            w = max(w, min(1.0 / max(prior, 1e-9), MAX_PRIOR_WEIGHT))
        return (self.accepted[r, b] + w * prior) / (self.trials[r, b] + w)

    def prior(self, q: float, rank: int) -> float:
        """A cell's acceptance before its trials: the identity, or the shaped prior."""
        if not self.shaped:
            return q
        return q ** (FIRST_EXPONENT if rank == 0 else LATER_EXPONENT)

    def pooled(self) -> float:
        """The share of all trials accepted, with `pooled_weight` observations at `pooled_prior`."""
        accepted = self.accepted.sum() + self.pooled_weight * self.pooled_prior
        return float(accepted / (self.trials.sum() + self.pooled_weight))

    def first_child(self, proposed_q: float | None = None) -> float:
        """A first child's acceptance before its probability is known: the share of first
        children accepted so far (their parent reached), with `prior_weight` observations at
        the prior over the probabilities they had. Before any, the prior at `proposed_q`, a
        probability the draft's first choices have had (lever.tree.builder passes the mean of
        its tree's), or one half. A flat half priced the first tree of a run as if every level
        lost half its reach: it stopped 3 deep where the draft was sure of 10 (docs/measurements.md,
        'The first tree')."""
        seen, took = self.trials[0].sum(), self.accepted[0].sum()
        if not seen:
            return self.prior(proposed_q, 0) if proposed_q is not None else 0.5
        prior = float(self.first_prior @ self.trials[0] / seen)
        return float((took + self.prior_weight * prior) / (seen + self.prior_weight))

    def observe(self, q: float, rank: int, accepted: bool) -> None:
        r, b = self._cell(q, rank)
        self.trials[r, b] += 1
        self.accepted[r, b] += accepted

    def observe_proposals(self, tokens, probs, target: int) -> None:
        """Off-policy: the draft's proposals at a position (most probable first, -1 pads) and
        the token the target chose there; each proposal is a trial."""
        for rank, (t, q) in enumerate(zip(tokens, probs)):
            if t < 0:
                break
            self.observe(float(q), rank, int(t) == target)

    def score(self, parents, q, rank, gains=None, model=None) -> float:
        """Expected accepted tokens of a tree (node 0 the root; parents before children) by
        this table: each node reached with its parent's chance times its own acceptance. A
        node `model` marks False (a free source proposed it) keeps its own estimate, the
        ratio of its gain to its parent's."""
        reach = [1.0]
        for i in range(1, len(parents)):
            p = parents[i]
            if model is None or model[i]:
                a = self(float(q[i]), int(rank[i]))
            else:
                a = gains[i] / gains[p] if gains[p] > 0 else 0.0
            reach.append(reach[p] * a)
        return float(sum(reach[1:]))

    def table(self) -> list[tuple[int, float, int, float]]:
        """(rank, bin centre, observations, estimate) of every observed cell."""
        return [(r, (b + 0.5) / self.n_bins, int(self.trials[r, b]), self((b + 0.5) / self.n_bins, r))
                for r in range(2) for b in range(self.n_bins) if self.trials[r, b]]
