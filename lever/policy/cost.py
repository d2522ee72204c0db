"""What growing a tree needs to know of time: the Cost protocol, and a cost model of three numbers.

Below lever.tree and the growth policies (lever.policy.growth), which price nodes through it;
lever.policy.cost_model's CostModel (measured, from a profile) and lever.policy.online's
corrected one implement it, and FlatCost stands in for tests and before a profile exists.
"""

from __future__ import annotations

from typing import Protocol

import attrs


class Cost(Protocol):
    """What the tree's growth needs from a cost model (lever.policy.cost_model)."""

    def verify_s(self, n_tokens: int) -> float: ...

    def expand_s(self, batch: int) -> float: ...  # one Draft expansion: the forward and the draft's lm_head

    def idle_s(self, n_tokens: int) -> float: ...

    # drafting in turns, the pass, Accept
    def cycle_s(self, n_tokens: int, draft_s: float, accept_rows: float) -> float: ...

    pass_delay_s: float  # a pass's wait for cores held by drafting ahead


@attrs.frozen
class Others:
    """The other requests' trees in a pass shared with this one's (lever.pipelines.batcher): a
    node's cost is then its compute share of a pass that computes theirs too and reads once for
    all, and the rate a node must raise is the pass's, every request's tokens per second."""

    n_nodes: int = 0  # their nodes in the pass
    tokens: float = 0.0  # their expected tokens from it (accepted + the bonus, each)


ALONE = Others()


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
