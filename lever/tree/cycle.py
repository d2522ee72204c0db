"""TreeCycle: a run's trees, one per cycle, as plain code the stage and the tests drive alike.

Below the stage (stages/tree_expand.py, which only moves messages), above the builder
(lever.tree.builder) and the learning (lever.tree.learning). After every Accepted, `start`
roots the next tree at the newest token and says what the draft must run first: the rows of
the accepted path it keeps, the accepted leaves it never ran (given), the rows it drafted
ahead that the tree adopts (carry); the stage trades requests for expansions with Draft until
the builder has nothing left to expand; `sent` records the tree and hands it to verification.
It owns what only the cycle knows: the last tree, what the draft has not been told yet (a
fallback cycle that grew the root alone: the lag), the target's committed rows and emitted
tokens, the shape the fallback chose.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np

from lever.dataflow.messages import Accepted, ExpandRequest, Expansion, TokenTree
from lever.model.grammar import Constraint
from lever.policy.acceptance import AcceptanceTable
from lever.policy.cost import ALONE, Cost, FlatCost, Others
from lever.policy.fallback import TREE, Shape
from lever.tree import lookahead
from lever.tree.builder import TreeBuilder
from lever.tree.config import MAX_TREE_SIZE, TreeExpandConfig
from lever.tree.free import FreeSources
from lever.tree.learning import CycleRecord, SentTree, TreeLearner
from lever.tree.lookahead import Lookahead

IDLE_PRIOR_CYCLES = 2  # pseudo-cycles at a hit share of one half, before drafting ahead has been seen


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


@attrs.frozen
class TreeStats:
    """The trees a run grew."""

    tree_sizes: tuple[int, ...]  # nodes of each speculative tree, root included
    lookahead_hits: int  # cycles that started from rows drafted ahead
    cycles: tuple[CycleRecord, ...] = ()  # every decoding cycle the run finished
    shapes: dict[str, int] = attrs.field(factory=dict)  # gain-cost with its fallback: cycles grown as each shape
    fallback_switches: int = 0  # times the fallback replaced gain-cost's tree by a simpler shape
    ahead_nodes: int = 0  # nodes drafted ahead while the target verified
    ahead_used: int = 0  # of them, nodes a later tree took without drafting them again

    @property
    def mean_nodes(self) -> float:
        return sum(self.tree_sizes) / len(self.tree_sizes) if self.tree_sizes else 1.0

    @property
    def drafted_nodes(self) -> int:
        """Draft tokens grown into trees (every node but each tree's root)."""
        return sum(max(s - 1, 0) for s in self.tree_sizes)

    @property
    def lookahead_hit_share(self) -> float:
        return self.lookahead_hits / len(self.tree_sizes) if self.tree_sizes else 0.0

    @property
    def ahead_used_share(self) -> float:
        """The share of drafting ahead a later tree used: the rest was compute spent for nothing."""
        return self.ahead_used / self.ahead_nodes if self.ahead_nodes else 0.0

    @property
    def predicted_cycle_s(self) -> float:
        return _mean(c.predicted_s for c in self.cycles)

    @property
    def measured_cycle_s(self) -> float:
        return _mean(c.measured_s for c in self.cycles)

    @property
    def predicted_tokens(self) -> float:
        return _mean(c.predicted_tokens for c in self.cycles)

    @property
    def measured_tokens(self) -> float:
        return _mean(c.tokens for c in self.cycles)


def prefill_tree(prompt: list[int]) -> TokenTree:
    return TokenTree.chain(0, prompt, n_given=len(prompt), keep=())


@attrs.define
class TreeCycle:
    """One run's cycle bookkeeping; `for_run` makes it with its learning."""

    config: TreeExpandConfig
    prompt: list[int]
    learner: TreeLearner
    n_ctx: int = 4096
    n_predict: int | None = None  # tokens the generation emits at most (Accept stops there); None: no end
    ahead_beside: bool = False  # drafting ahead runs on cores of its own beside the pass ([runtime] ahead_cores)
    constraint: Constraint | None = None  # a grammar on the generated text: it masks the free sources' proposals
    committed: int = 0  # target rows committed, to keep trees inside the context
    emitted: int = 0  # tokens Accept has emitted
    last: TreeBuilder | None = None  # the tree sent last
    last_sent: SentTree | None = None  # what was predicted of it when it was sent
    shape: Shape = TREE  # what it was grown as
    # (keep, given) the draft has not been told: the root alone grew without it (lever.policy.fallback)
    lag: tuple[tuple[int, ...], list[int]] | None = None
    tree_sizes: list[int] = attrs.field(factory=list)  # nodes of each speculative tree (for the summary)
    lookahead_hits: int = 0  # cycles that started from rows drafted ahead
    ahead_nodes: int = 0  # nodes drafted ahead, all cycles
    ahead_used: int = 0  # of them, nodes a later tree took
    # the other requests' trees in the passes this run shares (lever.pipelines.batcher.Batcher.others)
    others: Callable[[], Others] | None = None

    @classmethod
    def for_run(cls, config: TreeExpandConfig, prompt: list[int], *, cost: Cost | None = None, n_ctx: int = 4096,
                n_predict: int | None = None, acceptance: AcceptanceTable | None = None, ahead_beside: bool = False,
                committed: int = 0, greedy: bool = True, constraint: Constraint | None = None) -> TreeCycle:
        learner = TreeLearner.for_run(config, cost or FlatCost(), prompt, greedy=greedy, acceptance=acceptance)
        return cls(config=config, prompt=list(prompt), learner=learner, n_ctx=n_ctx, n_predict=n_predict,
                   ahead_beside=ahead_beside, constraint=constraint, committed=committed)

    @property
    def idle_value(self) -> float:
        """What a second of the pass's idle compute is worth: drafting ahead fills it, and saves
        that drafting next cycle when its guess holds (the share of cycles so far, a prior of
        one half before any)."""
        if not self.config.lookahead_nodes or not self.config.drafts:
            return 0.0
        n = len(self.tree_sizes)
        return (self.lookahead_hits + IDLE_PRIOR_CYCLES / 2) / (n + IDLE_PRIOR_CYCLES)

    def ahead_usable_s(self, cost: Cost) -> float:
        """The most drafting ahead spends in one pass: its node cap, in full rounds (0 where
        nothing drafts ahead, or no draft model runs)."""
        cfg = self.config
        if not cfg.lookahead_nodes or not cfg.drafts:
            return 0.0
        return -(-cfg.lookahead_nodes // cfg.round_nodes) * cost.expand_s(cfg.round_nodes)

    def stats(self) -> TreeStats:
        fb = self.learner.fallback
        return TreeStats(tuple(self.tree_sizes), self.lookahead_hits, tuple(self.learner.cycles),
                         dict(fb.cycles) if fb else {}, fb.switches if fb else 0,
                         ahead_nodes=self.ahead_nodes, ahead_used=self.ahead_used)

    def first_request(self) -> ExpandRequest:
        """The draft prefills the prompt while the target does."""
        n = len(self.prompt)
        return ExpandRequest(0, np.asarray(self.prompt, np.int64), np.arange(-1, n - 1, dtype=np.int32),
                             self.config.top_k, n, keep=())

    def observe(self, acc: Accepted, now_s: float) -> None:
        """What the cycle `acc` ends measured (lever.tree.learning.TreeLearner.observe)."""
        self.learner.observe(acc, self.last_sent, self.shape, now_s)

    def start(self, acc: Accepted) -> tuple[TreeBuilder, ExpandRequest | None]:
        """A new tree rooted at the newest token, and the draft request that starts it."""
        self.committed += len(acc.keep)
        self.emitted += len(acc.tokens)
        learner = self.learner
        learner.learn(self.last, acc, first=self.emitted - len(acc.tokens))
        remaining = MAX_TREE_SIZE + 1 if self.n_predict is None else self.n_predict - self.emitted
        if learner.lookup is not None:
            learner.lookup.extend(acc.tokens)  # the root, the text's last token, is the newest of them
        free = self._free_sources()
        self.shape = learner.shape()
        cfg = self.config if self.shape == TREE else attrs.evolve(self.config, policy=self.shape.policy,
                                                                  chain_length=max(self.shape.length, 1))
        b = TreeBuilder(cfg, learner.priced_by, acc.pass_id + 1, room=self.n_ctx - self.committed,
                        remaining=remaining, acceptance=learner.acceptance if learner.prices_by_table else None,
                        bar_rate=learner.bar_rate, free=free, others=self.others() if self.others else ALONE,
                        ahead=Lookahead(beside=self.ahead_beside, idle_value=self.idle_value,
                                        usable_s=self.ahead_usable_s(learner.priced_by)))
        b.add(acc.tokens[-1], -1, 1.0)
        if not self.config.drafts:
            if free is not None:
                b.next_round()  # the free sources alone: the tree grows here, no draft request
            return b, None
        prev = self.last
        if prev is None:  # after the prefill: the draft holds the whole prompt as pending rows
            keep, given = tuple(range(len(self.prompt))), []
        else:  # the accepted path's expanded rows stay; an accepted leaf the draft never ran joins now
            rows = [prev.nodes.row[n] for n in acc.keep]
            keep = (*prev.given_rows, *(r for r in rows if r >= 0))  # the given tokens precede the root
            given = [prev.nodes.tokens[n] for n, r in zip(acc.keep, rows) if r < 0]
        if self.lag is not None:  # the root alone grew meanwhile: the draft catches up now
            keep, given = self.lag[0], [*self.lag[1], *given]
        if not cfg.drafts:  # the root alone (the fallback's plain decoding): the draft waits
            self.lag = (keep, given)
            return b, None
        self.lag = None
        carry = () if given or prev is None else lookahead.carry_for(prev, acc)
        if not carry:
            req = b.request([0], given, keep)
            return b, attrs.evolve(req, given_proposals=bool(given) and learner.greedy)
        self.lookahead_hits += 1
        lookahead.adopt(b, prev, carry)
        return b, b.next_round(keep, carry)

    def expanded(self, b: TreeBuilder, req: ExpandRequest, exp: Expansion, draft_s: float) -> ExpandRequest | None:
        """The draft's answer to `req`, drafted in turns in `draft_s` (the cores were the
        draft's alone): learned from (the given leaves' proposals, the draft's time), grown
        into `b`; the next request of this cycle, or None once the tree is grown."""
        self.learner.learn_given(req, exp, b.nodes.tokens[0], first=self.emitted - req.n_given)
        self.learner.observe_draft(draft_s, req.tokens.size)
        return b.on_expansion(exp)

    def sent(self, b: TreeBuilder, acc: Accepted) -> TokenTree:
        """The tree `b` (grown after `acc`) goes to verification: recorded, and priced for the
        rate bar. What the last tree drafted ahead is counted now, with what this one used."""
        if self.last is not None:
            self.ahead_nodes += self.last.ahead.n_ahead
        self.ahead_used += b.ahead.n_used
        self.last = b
        self.tree_sizes.append(b.n_nodes)
        tree = b.tree(acc.pass_id + 1, acc.keep)
        self.last_sent = self.learner.sent(b, tree, self.shape)
        return tree

    def _free_sources(self) -> FreeSources | None:
        """The cycle's free sources, their proposals masked under a grammar by its mask after
        the generated text (the lookup's, past the prompt) and the path below the root."""
        lookup, constraint = self.learner.lookup, self.constraint
        if lookup is None:
            return None
        allowed = None
        if constraint is not None:
            generated = lookup.tokens[len(self.prompt):]
            allowed = lambda path: constraint.mask([*generated, *path])  # noqa: E731
        return FreeSources(lookup, self.learner.lookup_tables, allowed)
