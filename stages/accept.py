"""Accept: the last stage of a cycle, turning verified hidden states into output tokens.

It runs the output projection (lm_head, on the CPU) only for the nodes on the path being
accepted: logits at the last given node, the target's token, down into the child holding that
token, and again, until a node has no such child; the token chosen there is the bonus token.
Greedy output is therefore the target's own greedy output, whatever the tree held. It decides
which tree rows the KV caches keep and sends that back to Draft, and emits the tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import attrs
import numpy as np

from lever.graph import Stage
from lever.messages import Accepted, TokenTree, Verified
from lever.sampling import SamplingParams, sample
from lever.trace import Tracer


@attrs.frozen
class AcceptConfig:
    """Stopping rules of a generation."""

    n_predict: int = 128  # tokens to emit at most
    eos_ids: frozenset[int] = frozenset()  # tokens that end the generation
    n_ctx: int = 4096  # the target's context: stop before it is full
    full_lm_head: bool = False  # run the output projection on every node (EdgeLLM-like), not only the path


def children_of(tree: TokenTree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(tree.n_nodes)]
    for i in range(1, tree.n_nodes):
        kids[int(tree.parents[i])].append(i)
    return kids


def accept_tree(tree: TokenTree, hidden: np.ndarray, logits_fn: Callable[[np.ndarray], np.ndarray],
                params: SamplingParams, rng: np.random.Generator, budget: int,
                eos_ids: frozenset[int]) -> tuple[list[int], list[int], int]:
    """Walks the tree along the target's choices. Returns (emitted tokens, kept nodes, lm_head rows).

    With sampling, a node's draft children are accepted only when the target's sampled token
    equals them, which keeps the target's distribution exactly (each token is a fresh draw from
    the target's own distribution at that node).
    """
    kids = children_of(tree)
    node = tree.n_given - 1
    keep = list(range(tree.n_given))
    out: list[int] = []
    rows = 0
    while True:
        logits = logits_fn(hidden[node : node + 1])[0]
        rows += 1
        tok = sample(logits, params, rng)
        out.append(tok)
        nxt = next((c for c in kids[node] if int(tree.tokens[c]) == tok), None)
        if nxt is None or tok in eos_ids or len(out) >= budget:
            return out, keep, rows
        keep.append(nxt)
        node = nxt


@attrs.define
class Accept(Stage):
    """Verified -> Accepted (to Draft) and the emitted tokens (to whoever listens)."""

    name: str
    config: AcceptConfig
    params: SamplingParams
    logits_fn: Callable[[np.ndarray], np.ndarray]  # rows (n, n_embd) -> logits (n, n_vocab), on the CPU
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))
    INPUTS = {"verified": Verified}
    OUTPUTS = {"accepted": Accepted, "emitted": Accepted}
    OPTIONAL = frozenset({"emitted"})

    n_emitted: int = 0
    n_ctx_used: int = 0
    lm_head_rows: int = 0

    def __attrs_post_init__(self):
        self._rng = self.params.rng()

    def step(self, v: Verified) -> Accepted:
        tree = v.tree
        if self.config.full_lm_head and tree.n_nodes > 1:  # same tokens, the cost of every row
            self.logits_fn(v.hidden)
            self.lm_head_rows += tree.n_nodes
        budget = self.config.n_predict - self.n_emitted
        tokens, keep, rows = accept_tree(tree, v.hidden, self.logits_fn, self.params, self._rng, budget,
                                         self.config.eos_ids)
        self.lm_head_rows += rows
        self.n_emitted += len(tokens)
        self.n_ctx_used += len(keep)
        stop = ""
        if tokens[-1] in self.config.eos_ids:
            stop = "eos"
        elif self.n_emitted >= self.config.n_predict:
            stop = "length"
        elif self.n_ctx_used >= self.config.n_ctx:  # no row left for the next root
            stop = "context"
        return Accepted(tree.pass_id, tuple(tokens), tuple(keep), bool(stop), stop)

    async def run(self, inputs, outputs):
        emitted = outputs.get("emitted")
        async for v in inputs["verified"]:
            with self.tracer.span(self.name, f"accept {v.tree.pass_id}", batch=v.tree.n_nodes):
                acc = await anyio.to_thread.run_sync(self.step, v)
            if emitted is not None:
                await emitted.send(acc)
            await outputs["accepted"].send(acc)
            if acc.done:
                return
