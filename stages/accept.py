"""Accept: the last stage of a cycle, turning verified hidden states into output tokens.

It runs the output projection (lm_head, on the CPU) only for the nodes on the path being
accepted: logits at the last given node, the target's token, down into the child holding that
token, and again, until a node has no such child; the token chosen there is the bonus token.
The rows go in batches along the tree's likeliest chain, so the projection's weights are read
once per batch rather than once per accepted token.
Greedy output is therefore the target's own greedy output, whatever the tree held: at each node
the logit bias and the penalties (lever.model.sampling.penalize) see that node's own text, the
committed text then the path down to it, as autoregressive decoding would. It decides
which tree rows the KV caches keep and sends that back to TreeExpand, and emits the tokens.
Logits holding a NaN or an Inf end the run with one line naming the target's file and the
position (one max over each batch of rows, which the projection has just computed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import attrs
import numpy as np

from lever.dataflow.graph import Stage
from lever.dataflow.messages import Accepted, Proposals, TokenLogprob, TokenTree, Verified, children_of, likely_path
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.model.finite import NonFiniteError, finite, first_bad_row
from lever.model.grammar import Constraint
from lever.model.sampling import SamplingParams, distribution, rejection_sample, sample
from lever.model.stop import StopReason, stop_reason
from lever.model.transformer import HEAD_ROWS


class StopRule(Protocol):
    """A caller's reason to end a generation early, asked after every pass with the tokens it
    emitted: a stop string completed (StopReason.STOP), a request cancelled (CANCELLED); None goes on."""

    def __call__(self, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()) -> StopReason | None: ...


@attrs.frozen
class AcceptConfig:
    """Stopping rules of a generation."""

    n_predict: int = 128  # tokens to emit at most
    eos_ids: frozenset[int] = frozenset()  # tokens that end the generation
    n_ctx: int = 4096  # the target's context: stop before it is full
    full_lm_head: bool = False  # run the output projection on every node (EdgeLLM-like), not only the path
    stop: StopRule | None = None  # the caller's own stopping rule (stop strings, cancellation)
    logprobs: int | None = None  # each emitted token's logprob and this many alternatives'; None: not computed
    constraint: Constraint | None = None  # a grammar the text must follow (lever.model.grammar); None: free text


# Below any logit a model computes, and finite (the sampling functions refuse an Inf): a token the
# grammar forbids gets it, and exp() of it minus the row's max underflows to 0
FORBIDDEN_LOGIT = np.float32(-1e30)


def constrained(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """The logits with every token `allowed` does not hold pushed to FORBIDDEN_LOGIT (a copy)."""
    return logits if allowed is None else np.where(allowed, logits, FORBIDDEN_LOGIT).astype(logits.dtype)


def choose(logits: np.ndarray, drafted: Proposals | None, params: SamplingParams, rng: np.random.Generator,
           history: Sequence[int] = ()) -> int:
    """The target's token at one node, given the draft's tokens there (None: not expanded) and
    the text before it (`history`, for the penalties: the same as autoregressive decoding's)."""
    if params.exact_match or drafted is None or not len(drafted.tokens):
        # exactly autoregressive decoding's choice: llama.cpp's draws take one number per token
        # whatever the tree, and the walk goes on into the child holding the token chosen
        return sample(logits, params, rng, history)
    return rejection_sample(distribution(logits, params, history), drafted.tokens, drafted.q, rng)[0]


def logprob_of(logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """`token`'s log-probability under the softmax of `logits` (n_vocab,), and the `n_top`
    likeliest tokens' (ties to the lower id), in float64."""
    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + math.log(float(np.exp(x - m).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        k = min(n_top, len(x))
        idx = np.sort(np.argpartition(-x, k - 1)[:k])
        idx = idx[np.argsort(-x[idx], kind="stable")]
        top = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(int(token), float(x[token] - lse), top)


def accept_tree(tree: TokenTree, logits_at: Callable[[list[int]], np.ndarray], params: SamplingParams, *,
                rng: np.random.Generator, budget: int, eos_ids: frozenset[int],
                alive: np.ndarray | None = None, history: Sequence[int] = (),
                on_choice: Callable[[np.ndarray, int], None] | None = None,
                allowed: Callable[[list[int]], np.ndarray] | None = None) -> tuple[list[int], list[int], int]:
    """Walks the tree along the target's choices. Returns (emitted tokens, kept nodes, lm_head rows).

    `logits_at(nodes)` gives the target's logits, (len(nodes), n_vocab), at those tree nodes.

    The output projection runs in batches along the likely path (the chain of highest gains
    from where the walk stands), of at most HEAD_ROWS rows: one batched matmul reads the
    projection's weights once for all its rows, where row by row each row would read them
    again, and the logits held stay within what the memory plan counts. When the target leaves
    that chain, the rows past the fork were wasted and a new batch starts at the fork. The
    kernels are batch-invariant, so the logits, and the tokens, are those of one row at a time.

    Greedy, the target's token is the argmax. Sampling, it comes from multi-candidate
    rejection sampling over the draft's tokens at that node (`rejection_sample`), so it is
    distributed exactly as the target's own sample would be, and a drawn token that is a node
    of the tree is accepted as often as the two distributions allow.

    Nodes not `alive` (pruned in verification) are not descended into: chosen there, their
    token is the bonus token, as for a drawn token that was never a node. `on_choice(logits,
    token)` hears each emitted token with the target's logits it was chosen from.

    `allowed(tokens)` (a grammar: lever.model.grammar) gives the tokens that may follow the
    walk's own `tokens`; the target chooses among those alone, greedy or sampled, exactly as a
    constrained autoregressive decoder does, so a node the grammar forbids is never taken.
    """
    kids = children_of(tree)
    if alive is not None:
        kids = [[c for c in k if alive[c]] for k in kids]
    node = tree.n_given - 1
    keep = list(range(tree.n_given))
    out: list[int] = []
    rows = 0
    while True:
        path = likely_path(tree, kids, node, min(budget - len(out), HEAD_ROWS))
        logits = logits_at(path)
        rows += len(path)
        for j, at in enumerate(path):
            # the text before this node: what came before the tree, then the walk's own tokens
            before = [*history, *out] if params.penalizes else ()
            mask = None if allowed is None else allowed(out)
            tok = choose(constrained(logits[j], mask), tree.drafts.get(at), params, rng, before)
            if mask is not None and not mask[tok]:  # only a -inf bias sinks an allowed token below a forbidden one
                raise LeverError("logit_bias: bans every token the grammar allows here")
            if on_choice is not None:
                on_choice(logits[j], tok)
            out.append(tok)
            nxt = next((c for c in kids[at] if int(tree.tokens[c]) == tok), None)
            if nxt is None or tok in eos_ids or len(out) >= budget:
                return out, keep, rows
            keep.append(nxt)
            if j + 1 == len(path) or path[j + 1] != nxt:  # off the likely path: a new batch from here
                node = nxt
                break


@attrs.define
class Accept(Stage):
    """Verified -> Accepted (to TreeExpand) and the emitted tokens (to whoever listens)."""

    name: str
    config: AcceptConfig
    params: SamplingParams
    logits_fn: Callable[[np.ndarray], np.ndarray]  # rows (n, n_embd) -> logits (n, n_vocab), on the CPU
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))
    diagnose: Callable | None = None  # the target Model's nonfinite_logits: names its file and the tensor at fault
    INPUTS = {"verified": Verified}
    OUTPUTS = {"accepted": Accepted, "emitted": Accepted}
    OPTIONAL = frozenset({"emitted"})

    n_emitted: int = 0
    n_ctx_used: int = 0
    lm_head_rows: int = 0
    history: list[int] = attrs.field(factory=list)  # the text so far (its tail), for the penalties
    generated: list[int] = attrs.field(factory=list)  # the tokens emitted so far, when a grammar constrains them

    def __attrs_post_init__(self):
        self._rng = self.params.rng()

    @property
    def stream(self):
        """llama.cpp's draws this run takes (lever.model.draws.Stream), when it samples so; None
        otherwise. The draft reads ahead in it to propose what each position will draw."""
        return self._rng if self.params.draws == "llama.cpp" and not self.params.greedy else None

    def step(self, v: Verified) -> Accepted:
        tree = v.tree
        # n_predict's rest, and the context's: the text (prompt, reply) stops when it fills it
        budget = min(self.config.n_predict - self.n_emitted, self.config.n_ctx - self.n_ctx_used - 1)
        n_top = self.config.logprobs
        logprobs: list[TokenLogprob] = []
        on_choice = None if n_top is None else lambda row, tok: logprobs.append(logprob_of(row, tok, n_top))
        grammar = self.config.constraint
        allowed = None if grammar is None else lambda walked: grammar.mask([*self.generated, *walked])
        if self.config.full_lm_head and tree.n_nodes > 1:  # EdgeLLM-like: every row, in one batch
            every = self.logits_fn(v.hidden)
            self.lm_head_rows += tree.n_nodes
            logits_at = self._checked(v, lambda nodes: every[nodes])
            tokens, keep, _ = accept_tree(tree, logits_at, self.params, rng=self._rng, budget=budget,
                                          eos_ids=self.config.eos_ids, alive=v.alive, history=self._recent(tree),
                                          on_choice=on_choice, allowed=allowed)
            rows = 0
        else:
            logits_at = self._checked(v, lambda nodes: self.logits_fn(v.hidden[nodes]))
            tokens, keep, rows = accept_tree(tree, logits_at, self.params, rng=self._rng, budget=budget,
                                             eos_ids=self.config.eos_ids, alive=v.alive, history=self._recent(tree),
                                             on_choice=on_choice, allowed=allowed)
        self.lm_head_rows += rows
        self.n_emitted += len(tokens)
        if grammar is not None:
            self.generated += tokens
        if self.params.penalizes:
            self.history = [*self._recent(tree), *tokens][-self.params.repeat_last_n :]
        self.n_ctx_used += len(keep)
        # autoregressive decoding's rule (lever.model.stop); n_ctx_used: no row left for the next root
        c = self.config
        stop = stop_reason(tokens[-1], n_emitted=self.n_emitted, n_predict=c.n_predict, n_rows=self.n_ctx_used,
                           n_ctx=c.n_ctx, eos_ids=c.eos_ids)
        if c.stop is not None:  # the caller's reason comes first: its text ends where it says
            stop = c.stop(tuple(tokens), tuple(logprobs)) or stop
        pruned = () if v.alive is None else tuple(int(n) for n in np.flatnonzero(~v.alive))
        return Accepted(tree.pass_id, tuple(tokens), tuple(keep), stop is not None, stop, pruned,
                        drafted_kept=len(keep) - tree.n_given, logprobs=tuple(logprobs), tree=tree)

    def _checked(self, v: Verified, logits_at: Callable[[list[int]], np.ndarray]) -> Callable[[list[int]], np.ndarray]:
        """logits_at, refusing rows that hold a NaN or an Inf, or come from hidden states that do
        (the projection quantizes its input by the finite values: a -Inf there can give zeros).
        Only the rows the walk reads: a pruned node's may be anything."""
        def checked(nodes: list[int]) -> np.ndarray:
            logits = logits_at(nodes)
            if not finite(logits) or not finite(v.hidden[nodes]):  # a max and a min over each
                raise self._nonfinite(v, nodes, logits)
            return logits
        return checked

    def _nonfinite(self, v: Verified, nodes: list[int], logits: np.ndarray) -> NonFiniteError:
        """The failure path: the position in the text of the first bad row (the rows committed
        before this pass, then the node's depth in the tree) and, given the target's `diagnose`,
        its file and the tensor at fault."""
        positions = self.n_ctx_used + v.tree.depths()[np.asarray(nodes, np.int64)]
        if self.diagnose is not None:
            return self.diagnose(logits, positions, "target", v.hidden[nodes])
        bad = first_bad_row(logits)
        bad = first_bad_row(v.hidden[nodes]) if bad is None else bad
        return NonFiniteError("logits", role="target", position=int(positions[bad or 0]))

    def _recent(self, tree: TokenTree) -> list[int]:
        """The text before the tree's first new node: the history, and a prefill tree's given
        tokens (the prompt, not yet in it). A later tree's root was emitted already."""
        if not self.params.penalizes:
            return []
        if tree.n_given > 1 or not self.n_emitted:
            return [*self.history, *(int(t) for t in tree.tokens[: tree.n_given])][-self.params.repeat_last_n :]
        return self.history

    async def run(self, inputs, outputs):
        emitted = outputs.get("emitted")
        async for v in inputs["verified"]:
            t0 = time.perf_counter()
            with self.tracer.span(self.name, f"accept {v.tree.pass_id}", batch=v.tree.n_nodes):
                acc = await anyio.to_thread.run_sync(self.step, v)
            if v.timing is not None:
                acc = attrs.evolve(acc, timing=attrs.evolve(v.timing, accept_s=time.perf_counter() - t0))
            if emitted is not None:
                await emitted.send(acc)
            await outputs["accepted"].send(acc)
            if acc.done:
                return
