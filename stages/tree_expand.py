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

The stage only moves messages. The cycle's bookkeeping is lever.tree.cycle.TreeCycle, what a run
learns from its cycles (the acceptance table, the free sources' tables, the cost model's
corrections, the fallback) lever.tree.learning.TreeLearner: plain code, which tests drive
without an event loop. Its config, [tree_expand], is lever.tree.config.TreeExpandConfig.
"""

from __future__ import annotations

import time

import anyio
import attrs

from lever.dataflow.graph import Stage
from lever.dataflow.messages import Accepted, ExpandRequest, Expansion, TokenTree
from lever.dataflow.trace import Tracer
from lever.tree import lookahead
from lever.tree.builder import TreeBuilder
from lever.tree.cycle import TreeCycle, TreeStats, prefill_tree


async def _receive(stream) -> Accepted | None:
    try:
        return await stream.receive()
    except anyio.EndOfStream:
        return None


@attrs.define
class TreeExpand(Stage):
    """Accepted (+ the draft's Expansions) -> TokenTree for PrunedVerify, starting with the prompt."""

    name: str
    cycle: TreeCycle
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))
    INPUTS = {"accepted": Accepted, "expansion": Expansion}
    OUTPUTS = {"tree": TokenTree, "expand": ExpandRequest}
    OPTIONAL = frozenset({"expansion", "expand"})  # a run without the draft model needs no Draft

    def stats(self) -> TreeStats:
        return self.cycle.stats()

    async def draft_ahead(self, b: TreeBuilder, expand_out, expansions, accepted) -> Accepted | None:
        """Drafts ahead until the target's answer arrives (or there is nothing worth drafting)."""
        end_s = time.perf_counter() + b.cost.verify_s(b.n_sent + b.others.n_nodes)  # when the pass should be done
        while True:
            try:
                return accepted.receive_nowait()
            except anyio.WouldBlock:
                pass
            except anyio.EndOfStream:
                return None
            req = None
            if b.config.drafts and self.cycle.config.lookahead_nodes:
                req = lookahead.request(b, end_s - time.perf_counter())
            if req is None:
                return await _receive(accepted)
            with self.tracer.span(self.name, f"ahead {b.cycle}", kind="other"):
                await expand_out.send(req)
                b.absorb(await expansions.receive())

    async def run(self, inputs, outputs):
        tree_out, expand_out, expansions = outputs["tree"], outputs.get("expand"), inputs.get("expansion")
        accepted = inputs["accepted"]
        cycle = self.cycle
        await tree_out.send(prefill_tree(cycle.prompt))
        if cycle.config.drafts:
            await expand_out.send(cycle.first_request())
            await expansions.receive()
        acc = await _receive(accepted)
        while acc is not None:
            cycle.observe(acc, time.perf_counter())
            if acc.done:
                break
            with self.tracer.span(self.name, f"expand {acc.pass_id + 1}"):
                b, req = cycle.start(acc)
                while req is not None:
                    t0 = time.perf_counter()
                    await expand_out.send(req)
                    exp = await expansions.receive()
                    req = cycle.expanded(b, req, exp, time.perf_counter() - t0)
            await tree_out.send(cycle.sent(b, acc))
            acc = await self.draft_ahead(b, expand_out, expansions, accepted)
