"""TreeExpand: grows each cycle's token tree with the draft, and hands it to verification.

It starts the loop (the prompt is the first tree, prefilled by the target while the draft
prefills too), then after every `Accepted` it roots a new tree at the newest token and grows it
in rounds (lever.tree.builder.TreeBuilder): the draft expands the nodes added last (one batched
forward), their children become candidates, and the growth policy (lever.policy.growth) picks
which join the tree. Lever's picks by gain/cost: a candidate's gain is its estimated acceptance
probability (the product of draft probabilities along its path, mapped through the acceptance
table), its cost the latency it adds: its share of drafting plus the growth of the verification
pass at the new tree size, from the cost model (a streamed pass pays its flash read once, so
while reads dominate, nodes are nearly free). It adds the best candidate while that raises the
tree's expected rate (accepted tokens + 1 per second of cycle). Fixed shapes (none:
autoregressive; chain of k; k-ary tree) and a confidence bar without a latency model
(EdgeLLM-like) are other policies of the same stage, for the baselines. The free sources (prompt
lookup, n-grams: lever.tree.free) propose children at no drafting cost.

While the target verifies a tree, the CPU mostly waits on flash; TreeExpand uses that time to
draft ahead (`lookahead_nodes`, lever.tree.lookahead): when its guess of the next root holds,
the next tree starts from those rows at no drafting cost.

After each cycle TreeExpand learns: the acceptance table from the nodes the target reached
(`learn`), the free sources' tables from every emitted token, and the cost model's corrections
from what the cycle measured (`observe`, lever.policy.online).
"""

from __future__ import annotations

import time
from typing import Protocol

import anyio
import attrs
import numpy as np

from lever.dataflow.graph import Stage
from lever.dataflow.messages import Accepted, ExpandRequest, Expansion, TokenTree
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.model.grammar import Constraint
from lever.policy.acceptance import MODEL_PRIOR_WEIGHT, AcceptanceTable
from lever.policy.cost_model import CostModel
from lever.policy.fallback import TREE, Fallback, Shape
from lever.policy.growth import POLICIES, GrowthPolicy, Source
from lever.policy.lookup import SOURCES, Lookup
from lever.policy.online import OnlineCost, Scales
from lever.tree import lookahead
from lever.tree.builder import MAX_TREE_SIZE, TreeBuilder
from lever.tree.free import FREE_PRIOR, FreeSources

BAR_WEIGHT = 0.5  # of the newest tree in the moving rate bar
IDLE_PRIOR_CYCLES = 2  # pseudo-cycles at a hit share of one half, before drafting ahead has been seen


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

    @property
    def draft_rows(self) -> int:
        """Pending draft rows one cycle may hold: rows carried in, the tree, rows drafted ahead."""
        return self.max_nodes + 2 * self.lookahead_nodes + 1


class Cost(Protocol):
    """What TreeExpand needs from the cost model (lever.policy.cost_model)."""

    def verify_s(self, n_tokens: int) -> float: ...

    def expand_s(self, batch: int) -> float: ...  # one Draft expansion: the forward and the draft's lm_head

    def idle_s(self, n_tokens: int) -> float: ...

    # drafting in turns, the pass, Accept
    def cycle_s(self, n_tokens: int, draft_s: float, accept_rows: float) -> float: ...

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


@attrs.frozen
class CycleRecord:
    """One decoding cycle, as the cost model predicted it and as it went."""

    nodes: int  # the tree's nodes, root included
    predicted_s: float  # drafting in turns, the pass and Accept, by the cost model of that cycle
    predicted_tokens: float  # expected accepted tokens + the bonus token
    measured_s: float  # from the previous Accepted to this one
    tokens: int  # tokens the cycle emitted
    scales: Scales  # the online corrections the tree was priced with


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
    OPTIONAL = frozenset({"expansion", "expand"})  # a run without the draft model needs no Draft

    tree_sizes: list[int] = attrs.field(factory=list)  # nodes of each speculative tree (for the summary)
    lookahead_hits: int = 0  # cycles that started from rows drafted ahead
    ahead_nodes: int = 0  # nodes drafted ahead, all cycles
    ahead_used: int = 0  # of them, nodes a later tree took
    # the draft's acceptance, learned from each cycle: gain-cost's gains go through it (unless
    # [tree_expand] acceptance = "identity"), and every policy's trees are scored by it
    acceptance: AcceptanceTable | None = None
    ahead_beside: bool = False  # drafting ahead runs on cores of its own beside the pass ([runtime] ahead_cores)
    online: OnlineCost | None = None  # the cost model corrected by measurements ([tree_expand] adapt)
    cycles: list[CycleRecord] = attrs.field(factory=list)
    greedy: bool = True  # free sources propose only under greedy verification (sampling needs a draft distribution)
    lookup: Lookup | None = None  # the free sources over the text so far ([tree_expand] sources)
    constraint: Constraint | None = None  # a grammar on the generated text: it masks the free sources' proposals
    lookup_tables: dict = attrs.field(factory=dict)  # a free source -> its acceptance table, learned from the text
    fallback: Fallback | None = None  # gain-cost's check against the shapes it contains ([tree_expand] fallback)
    _shape: Shape = TREE  # what the last tree sent was grown as
    # (keep, given) the draft has not been told: the root alone grew without it (lever.policy.fallback)
    _lag: tuple[tuple[int, ...], list[int]] | None = None
    _committed: int = 0  # target rows committed, to keep trees inside the context
    _emitted: int = 0  # tokens Accept has emitted
    _bar_rate: float = 0.0  # moving estimate of the predicted rate of the trees sent, tokens/s
    _last: TreeBuilder | None = None
    _last_accepted_t: float | None = None  # when the previous Accepted arrived

    def __attrs_post_init__(self):
        if self.acceptance is None and self.config.drafts:
            self.acceptance = AcceptanceTable(prior_weight=MODEL_PRIOR_WEIGHT, shaped=self.greedy)
        cfg = self.config
        if self.fallback is None and cfg.fallback and cfg.drafts and cfg.growth.learns_acceptance:
            self.fallback = Fallback(self.config.max_depth, greedy=self.greedy)
        if self.online is None and self.config.adapt and isinstance(self.cost, CostModel):
            self.online = OnlineCost(self.cost)
        if self.lookup is None and self.greedy and self.config.lookup_sources:
            self.lookup = Lookup(self.config.lookup_sources)
            self.lookup.extend(self.prompt)
            if self.config.growth.learns_acceptance:
                self.lookup_tables = {x: AcceptanceTable(pooled_prior=FREE_PRIOR) for x in self.config.lookup_sources}

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

    @property
    def idle_value(self) -> float:
        """What a second of the pass's idle compute is worth: drafting ahead fills it, and saves
        that drafting next cycle when its guess holds (the share of cycles so far, a prior of
        one half before any)."""
        if not self.config.lookahead_nodes or not self.config.drafts:
            return 0.0
        n = len(self.tree_sizes)
        return (self.lookahead_hits + IDLE_PRIOR_CYCLES / 2) / (n + IDLE_PRIOR_CYCLES)

    def stats(self) -> TreeStats:
        fb = self.fallback
        return TreeStats(tuple(self.tree_sizes), self.lookahead_hits, tuple(self.cycles),
                         dict(fb.cycles) if fb else {}, fb.switches if fb else 0,
                         ahead_nodes=self.ahead_nodes, ahead_used=self.ahead_used)

    def sent(self, b: TreeBuilder, tree: TokenTree) -> None:
        """A tree goes to verification: its predicted time and tokens, and the rate bar."""
        b.sent_s, b.sent_tokens = tree.cycle_s, b.expected_accepted() + 1
        n = b.nodes
        b.scored_tokens = b.sent_tokens if self.acceptance is None else 1 + self.acceptance.score(
            n.parents, n.q, n.rank, n.gain, [x == Source.MODEL for x in n.source])
        if b.sent_s > 0 and self._shape == TREE:  # the bar is the trees' own, not a fallback shape's
            rate = b.model_rate or b.sent_tokens / b.sent_s  # the model's trees set the model's bar
            self._bar_rate = rate if not self._bar_rate else BAR_WEIGHT * rate + (1 - BAR_WEIGHT) * self._bar_rate

    def observe(self, acc: Accepted, now_s: float) -> None:
        """What the cycle that `acc` ends measured: into the online estimates and the record."""
        prev = self._last
        if prev is not None and prev.n_sent and self._last_accepted_t is not None and self.speculates:
            measured_s = now_s - self._last_accepted_t
            self.cycles.append(CycleRecord(prev.n_sent, prev.sent_s, prev.scored_tokens, measured_s,
                                           len(acc.tokens), self.online.scales if self.online else Scales()))
            if self.online is not None:
                self.online.observe_cycle(measured_s, prev.sent_s)
            if self.fallback is not None:
                self.fallback.observe_cycle(self._shape, len(acc.tokens), prev.sent_s)
        self._last_accepted_t = now_s
        if self.online is not None and acc.timing is not None and acc.pass_id > 0:  # the prefill is not a cycle
            self.online.observe_pass(acc.timing, len(acc.tokens))

    def learn(self, prev: TreeBuilder | None, acc: Accepted) -> None:
        """The model's table, greedy: at every emitted token whose parent the draft expanded,
        each of the draft's proposals there was a trial, whatever tree was grown (off-policy;
        an accepted leaf the draft never ran is seen in the next cycle's first expansion,
        `learn_given`). Sampled: every sent node whose parent the target reached was a trial,
        accepted or not (unless pruned). The free sources' tables: what they would have
        proposed at each emitted token (`Lookup.trials`), before the text is extended."""
        for source, q, rank, right in self.lookup.trials(acc.tokens) if self.lookup_tables else ():
            self.lookup_tables[source].observe(q, rank, right)
        if self.acceptance is None or prev is None:
            return
        if self.greedy:
            first = self._emitted - len(acc.tokens)  # the index of the cycle's first emitted token
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

    def learn_given(self, req: ExpandRequest, exp: Expansion, root: int) -> None:
        """The draft's proposals at the accepted leaves it never ran (the cycle's given
        tokens): each given token's next is the following one, the last one's the root."""
        if exp.given is None or self.acceptance is None:
            return
        given = [int(t) for t in req.tokens[: req.n_given]]
        first = self._emitted - len(given)  # the index of the first given token's next
        for j, ((tokens, probs), nxt) in enumerate(zip(zip(*exp.given), [*given[1:], root])):
            self.observe_proposals(first + j, tokens, probs, nxt)

    def observe_proposals(self, index: int, tokens, probs, target: int) -> None:
        """The draft's proposals before the emitted token `index`, which was `target`."""
        self.acceptance.observe_proposals(tokens, probs, target)
        if self.fallback is not None and len(tokens):
            self.fallback.observe_hit(index, int(tokens[0]) == target)

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
        free = _free_sources(self)
        self._shape = TREE
        if self.fallback is not None:
            self._shape = self.fallback.choose(self.priced_by, self.acceptance.first_child())
        cfg = self.config if self._shape == TREE else attrs.evolve(self.config, policy=self._shape.policy,
                                                                   chain_length=max(self._shape.length, 1))
        b = TreeBuilder(cfg, self.priced_by, acc.pass_id + 1, room=self.n_ctx - self._committed,
                        remaining=remaining, acceptance=self.acceptance if self.prices_by_table else None,
                        ahead_beside=self.ahead_beside,
                        bar_rate=self._bar_rate, idle_value=self.idle_value, free=free)
        b.add(acc.tokens[-1], -1, 1.0)
        if not self.config.drafts:
            if free is not None:
                b.next_round()  # the free sources alone: the tree grows here, no draft request
            return b, None
        prev = self._last
        if prev is None:  # after the prefill: the draft holds the whole prompt as pending rows
            keep, given = tuple(range(len(self.prompt))), []
        else:  # the accepted path's expanded rows stay; an accepted leaf the draft never ran joins now
            rows = [prev.nodes.row[n] for n in acc.keep]
            keep = (*prev.given_rows, *(r for r in rows if r >= 0))  # the given tokens precede the root
            given = [prev.nodes.tokens[n] for n, r in zip(acc.keep, rows) if r < 0]
        if self._lag is not None:  # the root alone grew meanwhile: the draft catches up now
            keep, given = self._lag[0], [*self._lag[1], *given]
        if not cfg.drafts:  # the root alone (the fallback's plain decoding): the draft waits
            self._lag = (keep, given)
            return b, None
        self._lag = None
        carry = () if given or prev is None else lookahead.carry_for(prev, acc)
        if not carry:
            req = b.request([0], given, keep)
            return b, attrs.evolve(req, given_proposals=bool(given) and self.greedy)
        self.lookahead_hits += 1
        lookahead.adopt(b, prev, carry)
        return b, b.next_round(keep, carry)

    async def draft_ahead(self, b: TreeBuilder, expand_out, expansions, accepted) -> Accepted | None:
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
            if b.config.drafts and self.config.lookahead_nodes:
                req = lookahead.request(b, end_s - time.perf_counter())
            if req is None:
                return await _receive(accepted)
            with self.tracer.span(self.name, f"ahead {b.cycle}", kind="other"):
                await expand_out.send(req)
                b.absorb(await expansions.receive())

    async def run(self, inputs, outputs):
        tree_out, expand_out, expansions = outputs["tree"], outputs.get("expand"), inputs.get("expansion")
        accepted = inputs["accepted"]
        await tree_out.send(prefill_tree(self.prompt))
        if self.config.drafts:
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
                    self.learn_given(req, exp, b.nodes.tokens[0])
                    if self.online is not None:  # drafted in turns: the cores were the draft's alone
                        self.online.observe_draft(time.perf_counter() - t0, req.tokens.size)
                    req = b.on_expansion(exp)
            if self._last is not None:
                self.ahead_nodes += self._last.ahead.n_ahead
            self.ahead_used += b.ahead.n_used
            self._last = b
            self.tree_sizes.append(b.n_nodes)
            tree = b.tree(acc.pass_id + 1, acc.keep)
            self.sent(b, tree)
            await tree_out.send(tree)
            acc = await self.draft_ahead(b, expand_out, expansions, accepted)


def _free_sources(expand: TreeExpand) -> FreeSources | None:
    """A cycle's free sources, their proposals masked under a grammar by its mask after the
    generated text (the lookup's, past the prompt) and the path below the root."""
    if expand.lookup is None:
        return None
    allowed, constraint = None, expand.constraint
    if constraint is not None:
        generated = expand.lookup.tokens[len(expand.prompt):]
        allowed = lambda path: constraint.mask([*generated, *path])  # noqa: E731
    return FreeSources(expand.lookup, expand.lookup_tables, allowed)
