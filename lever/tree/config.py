"""[tree_expand]: how trees grow, read by the tree package, the growth policies and the stage.

Below lever.tree.builder and the stage (stages/tree_expand.py), above the growth policies
(lever.policy.growth), which see it through their `GrowthConfig` protocol. Every cap bounds every
policy; gain-cost usually stops well before them.
"""

from __future__ import annotations

import attrs

from lever.errors import LeverError
from lever.policy.growth import POLICIES, GrowthPolicy, Source
from lever.policy.lookup import SOURCES

# bound on a tree's nodes, depth and fan-out: one pass verifies it, one draft forward expands a round
MAX_TREE_SIZE = 1024
# a tree's node cap when [pipeline] parallel trees share a pass's (`per_tree`), at least: a deep
# enough chain for one request running alone
MIN_SHARED_NODES = 16


def _sources(names) -> tuple:
    """[tree_expand] sources as Source members (an unknown name stays, for the check to name)."""
    return tuple(Source(x) if x in SOURCES else x for x in names)


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
    # drafting ahead takes only nodes at least this likely to be reached (their gain): a row
    # drafted ahead is a forward's compute, and most are never used (lever.tree.lookahead)
    lookahead_min_gain: float = 0.0
    # gain-cost: "online" learns draft probability -> acceptance from each cycle; "calibrated"
    # starts from `lever calibrate`'s table and learns on; "identity" takes the draft's word
    acceptance: str = "online"
    # who proposes children: the draft model, "prompt-lookup", "ngram" (lever.policy.lookup);
    # without "model", no draft model runs
    sources: tuple[str, ...] = attrs.field(default=(Source.MODEL,), converter=_sources)
    # correct the cost model from each cycle's measured pass, Accept and draft times
    # (lever.policy.online); a seeded sampled run keeps the profile, to stay reproducible
    adapt: bool = True
    # gain-cost: grow a chain or the root alone for a while when, replayed on the same tokens,
    # it would have beaten the trees' recent rate (lever.policy.fallback)
    fallback: bool = True
    # a tree verified in a pass beside other requests' trees (lever serve --parallel) is priced
    # with their nodes in the pass and their tokens in its rate (lever.policy.cost.Others); a
    # seeded sampled run never is: its trees, and so its draws, must not follow the others'
    price_shared: bool = True

    def __attrs_post_init__(self):
        if self.policy not in POLICIES:  # the names: lever.policy.growth
            raise LeverError(f"[tree_expand] policy: unknown policy {self.policy!r} (known: {', '.join(POLICIES)})")
        for name in ("max_nodes", "max_depth", "top_k", "round_nodes", "chain_length", "kary_depth"):
            if not 1 <= getattr(self, name) <= MAX_TREE_SIZE:
                raise LeverError(f"[tree_expand] {name}: must be in [1, {MAX_TREE_SIZE}], got {getattr(self, name)}")
        if self.acceptance not in ("online", "identity", "calibrated"):
            raise LeverError(f"[tree_expand] acceptance: {self.acceptance!r} is not 'online', 'identity' or "
                             f"'calibrated'")
        unknown = [x for x in self.sources if x not in SOURCES]
        if not self.sources or unknown or len(set(self.sources)) != len(self.sources):
            raise LeverError(f"[tree_expand] sources: {[str(x) for x in self.sources]} must be distinct names of "
                             f"{', '.join(SOURCES)}")
        if not 0 <= self.lookahead_nodes <= MAX_TREE_SIZE:
            raise LeverError(f"[tree_expand] lookahead_nodes: must be in [0, {MAX_TREE_SIZE}], "
                             f"got {self.lookahead_nodes}")
        if not 0.0 <= self.lookahead_min_gain <= 1.0:  # NaN fails too
            raise LeverError(f"[tree_expand] lookahead_min_gain: must be in [0, 1], got {self.lookahead_min_gain}")

    @property
    def growth(self) -> GrowthPolicy:
        return POLICIES[self.policy]

    @property
    def drafts(self) -> bool:
        """Whether the draft model runs: a policy that grows trees, with "model" among its
        sources. Asked of the normalised config (lever.pipelines.plan.RunPlan.tree), this is
        the one answer every part of a run reads."""
        return self.growth.speculates and Source.MODEL in self.sources

    @property
    def lookup_sources(self) -> tuple[Source, ...]:
        """The free sources (lever.policy.lookup), for a policy that grows trees at all."""
        return tuple(x for x in self.sources if x != Source.MODEL) if self.growth.speculates else ()

    def per_tree(self, parallel: int) -> TreeExpandConfig:
        """The caps of one of `parallel` trees that share a pass ([pipeline] parallel): max_nodes
        bounds the pass, shared among them (each at least MIN_SHARED_NODES), and depth and
        drafting ahead within a tree's share. A crowded pass prices small trees anyway
        (lever.policy.cost.Others); the caps keep each request's drafting and head, which the
        memory plan holds once per request, to its share."""
        if parallel <= 1:
            return self
        nodes = min(self.max_nodes, max(-(-self.max_nodes // parallel), MIN_SHARED_NODES))
        return attrs.evolve(self, max_nodes=nodes, max_depth=min(self.max_depth, max(nodes - 1, 1)),
                            lookahead_nodes=min(self.lookahead_nodes, nodes))

    @property
    def draft_rows(self) -> int:
        """Pending draft rows one cycle may hold: rows carried in, the tree, rows drafted ahead."""
        return self.max_nodes + 2 * self.lookahead_nodes + 1
