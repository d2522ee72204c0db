"""TreeExpand: grows each cycle's token tree with the draft, and hands it to verification.

It starts the loop (the prompt is the first tree, prefilled by the target while the draft
prefills too), then after every `Accepted` it roots a new tree at the newest token and grows it
in rounds: the draft expands the nodes added last (one batched forward), their children become
candidates, and the policy picks which candidates join the tree. The Lever policy picks by
gain/cost: a candidate's gain is its estimated acceptance probability (the product of draft
probabilities along its path, mapped through a calibration table), its cost the latency it
adds: its share of drafting plus the growth of the verification pass at the new tree size,
from the cost model (a streamed pass pays its flash read once, so while reads dominate, nodes
are nearly free). It adds the best candidate while that raises the tree's expected rate
(accepted tokens + 1 per second of cycle). Fixed shapes (none: autoregressive; chain of k;
k-ary tree) and a confidence bar without a latency model (EdgeLLM-like) are other policies of
the same stage, for the baselines.
"""

from __future__ import annotations

import heapq
from typing import Protocol

import attrs
import numpy as np

from lever.errors import LeverError
from lever.graph import Stage
from lever.messages import Accepted, ExpandRequest, Expansion, TokenTree
from lever.trace import Tracer

POLICIES = ("none", "chain", "kary", "confidence", "gain-cost")


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

    def __attrs_post_init__(self):
        if self.policy not in POLICIES:
            raise LeverError(f"[tree_expand] policy: unknown policy {self.policy!r} (known: {', '.join(POLICIES)})")
        for name in ("max_nodes", "max_depth", "top_k", "round_nodes", "chain_length", "kary_depth"):
            if getattr(self, name) < 1:
                raise LeverError(f"[tree_expand] {name}: must be >= 1, got {getattr(self, name)}")


class Cost(Protocol):
    """What TreeExpand needs from the cost model (lever.cost_model)."""

    def verify_s(self, n_tokens: int) -> float: ...

    def draft_s(self, batch: int) -> float: ...


@attrs.frozen
class FlatCost:
    """A cost model of three numbers, for tests and before a profile exists: a pass reads its
    layers once (read_s) while computing n tokens (compute_per_token_s each), whichever is longer."""

    read_s: float = 0.5
    compute_per_token_s: float = 0.01
    draft_step_s: float = 0.02

    def verify_s(self, n_tokens: int) -> float:
        return max(self.read_s, self.compute_per_token_s * n_tokens)

    def draft_s(self, batch: int) -> float:
        return self.draft_step_s


@attrs.define
class TreeBuilder:
    """One cycle's tree, grown round by round from the draft's expansions (no event loop)."""

    config: TreeExpandConfig
    cost: Cost
    cycle: int
    room: int  # nodes the context still has space for
    tokens: list[int] = attrs.field(factory=list)
    parents: list[int] = attrs.field(factory=list)
    depth: list[int] = attrs.field(factory=list)
    gain: list[float] = attrs.field(factory=list)  # estimated acceptance probability of each node
    row: list[int] = attrs.field(factory=list)  # the node's pending row in the draft (-1: not expanded)
    node_of_row: dict[int, int] = attrs.field(factory=dict)
    candidates: list = attrs.field(factory=list)  # heap of (-gain, seq, parent node, token)
    draft_s: float = 0.0  # estimated drafting time of this cycle so far
    n_pending: int = 0  # rows this cycle has added to the draft's cache
    _seq: int = 0

    @property
    def n_nodes(self) -> int:
        return len(self.tokens)

    @property
    def limit(self) -> int:
        """Nodes this tree may reach: the caps, the context, and a chain's fixed length."""
        cap = min(self.config.max_nodes, self.room)
        return min(cap, self.config.chain_length + 1) if self.config.policy == "chain" else cap

    def add(self, token: int, parent: int, gain: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(0 if parent < 0 else self.depth[parent] + 1)
        self.gain.append(gain)
        self.row.append(-1)
        return self.n_nodes - 1

    def request(self, nodes: list[int], given: list[int] = (), commit: tuple[int, ...] | None = None) -> ExpandRequest:
        """Ask the draft to expand `nodes` (after extending its cache with `given` tokens)."""
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
        self.draft_s += self.cost.draft_s(len(toks))
        return ExpandRequest(self.cycle, np.asarray(toks, np.int64), np.asarray(parents, np.int32),
                             self.config.top_k, len(given), commit)

    def on_expansion(self, exp: Expansion) -> ExpandRequest | None:
        """Take the draft's proposals; pick the next round; None when the tree is done."""
        for row, toks, probs in zip(exp.rows, exp.child_tokens, exp.child_probs):
            node = self.node_of_row[int(row)]
            for t, q in zip(toks, probs):
                g = self.gain[node] * float(q)
                heapq.heappush(self.candidates, (-g, self._seq, node, int(t)))
                self._seq += 1
        added = self.select_round()
        if self.n_nodes >= self.limit:  # full: the children of what was added could not join
            return None
        expand = [n for n in added if self.depth[n] < self.config.max_depth]
        if self.config.policy == "kary":
            expand = [n for n in expand if self.depth[n] < self.config.kary_depth]
        return self.request(expand) if expand else None

    def select_round(self) -> list[int]:
        policy = self.config.policy
        if policy == "chain":
            return self._take(1)
        if policy == "kary":
            return self._take(len(self.candidates))
        if policy == "gain-cost":
            return self._take_while_worth(self.config.round_nodes)
        if policy == "confidence":  # EdgeLLM-like: no latency model, a fixed bar on acceptance
            return self._take_while_confident(self.config.round_nodes)
        return []

    def _take_while_confident(self, n: int) -> list[int]:
        added = []
        while self.candidates and len(added) < n and self.n_nodes < self.limit \
                and -self.candidates[0][0] >= self.config.confidence:
            neg_g, _, parent, tok = heapq.heappop(self.candidates)
            added.append(self.add(tok, parent, -neg_g))
        return added

    def _take(self, n: int) -> list[int]:
        added = []
        while self.candidates and len(added) < n and self.n_nodes < self.limit:
            neg_g, _, parent, tok = heapq.heappop(self.candidates)
            added.append(self.add(tok, parent, -neg_g))
        if self.config.policy == "chain":
            self.candidates.clear()  # a chain keeps only the best child of its last node
        return added

    def expected_accepted(self) -> float:
        return float(sum(self.gain[1:]))

    def latency_s(self, n_nodes: int | None = None, extra_draft_s: float = 0.0) -> float:
        return self.draft_s + extra_draft_s + self.cost.verify_s(self.n_nodes if n_nodes is None else n_nodes)

    def _take_while_worth(self, n: int) -> list[int]:
        """Adds the best candidates while each raises (E + 1) / latency."""
        added = []
        per_node_draft = self.cost.draft_s(n) / n  # the round's expansion, shared by its nodes
        while self.candidates and len(added) < n and self.n_nodes < self.limit:
            g = -self.candidates[0][0]
            e, lat = self.expected_accepted(), self.latency_s(extra_draft_s=per_node_draft * len(added))
            new_lat = self.latency_s(self.n_nodes + 1, per_node_draft * (len(added) + 1))
            if (e + 1 + g) / new_lat < (e + 1) / lat:
                break
            _, _, parent, tok = heapq.heappop(self.candidates)
            added.append(self.add(tok, parent, g))
        return added

    def tree(self, pass_id: int, commit: tuple[int, ...]) -> TokenTree:
        return TokenTree(pass_id, np.asarray(self.tokens, np.int64), np.asarray(self.parents, np.int32), 1,
                         np.asarray(self.gain, np.float32), commit)


def prefill_tree(prompt: list[int]) -> TokenTree:
    return TokenTree.chain(0, prompt, n_given=len(prompt), commit=())


@attrs.define
class TreeExpand(Stage):
    """Accepted (+ the draft's Expansions) -> TokenTree for PrunedVerify, starting with the prompt."""

    name: str
    config: TreeExpandConfig
    prompt: list[int]
    cost: Cost = attrs.field(factory=FlatCost)
    n_ctx: int = 4096
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))
    INPUTS = {"accepted": Accepted, "expansion": Expansion}
    OUTPUTS = {"tree": TokenTree, "expand": ExpandRequest}
    OPTIONAL = frozenset({"expansion", "expand"})  # policy none needs no draft

    tree_sizes: list[int] = attrs.field(factory=list)  # nodes of each speculative tree (for the summary)
    _committed: int = 0  # target rows committed, to keep trees inside the context
    _last: TreeBuilder | None = None

    @property
    def drafting(self) -> bool:
        return self.config.policy != "none"

    def first_request(self) -> ExpandRequest:
        """The draft prefills the prompt while the target does."""
        n = len(self.prompt)
        return ExpandRequest(0, np.asarray(self.prompt, np.int64), np.arange(-1, n - 1, dtype=np.int32),
                             self.config.top_k, n, commit=())

    def start_cycle(self, acc: Accepted) -> tuple[TreeBuilder, ExpandRequest | None]:
        """A new tree rooted at the newest token, and the draft request that starts it."""
        self._committed += len(acc.keep)
        b = TreeBuilder(self.config, self.cost, acc.pass_id + 1, room=self.n_ctx - self._committed)
        b.add(acc.tokens[-1], -1, 1.0)
        if not self.drafting:
            return b, None
        prev = self._last
        if prev is None:  # after the prefill: the draft holds the whole prompt as pending rows
            commit, given = tuple(range(len(self.prompt))), []
        else:  # the accepted path's expanded rows stay; an accepted leaf the draft never ran joins now
            rows = [prev.row[n] for n in acc.keep]
            commit = tuple(r for r in rows if r >= 0)
            given = [prev.tokens[n] for n, r in zip(acc.keep, rows) if r < 0]
        return b, b.request([0], given, commit)

    async def run(self, inputs, outputs):
        tree_out, expand_out, expansions = outputs["tree"], outputs.get("expand"), inputs.get("expansion")
        await tree_out.send(prefill_tree(self.prompt))
        if self.drafting:
            await expand_out.send(self.first_request())
            await expansions.receive()
        async for acc in inputs["accepted"]:
            if acc.done:
                return
            with self.tracer.span(self.name, f"expand {acc.pass_id + 1}"):
                b, req = self.start_cycle(acc)
                while req is not None:
                    await expand_out.send(req)
                    req = b.on_expansion(await expansions.receive())
            self._last = b
            self.tree_sizes.append(b.n_nodes)
            await tree_out.send(b.tree(acc.pass_id + 1, acc.keep))
