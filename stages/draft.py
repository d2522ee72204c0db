"""Draft: the small draft model, resident in DRAM, proposing children for tree nodes.

TreeExpand sends it the nodes to expand; one batched draft forward runs them all with tree
attention over the draft's own KV cache (each node sees the committed prefix and its own
ancestors), and it answers with each node's most probable next tokens and their
probabilities; when the run samples, with tokens drawn from its distribution instead, which
the target's rejection sampling (Accept) needs. Rows added during a cycle are pending; the first
request of the next cycle says which to keep (the accepted path), so the draft's cache follows
the accepted text exactly.
A NaN or an Inf in the draft's hidden state or logits ends the run with one line naming the
draft's file, the position and the layer or tensor at fault; the checks reuse reductions the
forward and the softmax make anyway.
When the draft's token table is not the target's (lever.gguf.vocab_map), messages stay in target
ids: tokens fed in go through the map to draft ids, draft tokens with no target counterpart are
masked before the top-k or the draw, and what comes out goes back to target ids, with the drawn-from
distribution q over the target's vocabulary. With the same table there is no map and none of it runs.
Under a grammar (lever.model.grammar), each expanded node's logits are masked by what the grammar
allows after that node's own path before the top-k or the draw: no child it forbids is proposed,
and the probabilities are the draft's over the allowed tokens (a node the grammar already refused
gets no children).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import attrs
import numpy as np

from lever.backends.cpu import native
from lever.backends.cpu.kv_cache import KVCache
from lever.dataflow.compute import AHEAD, DRAFT, ComputeSlot, run_on
from lever.dataflow.graph import Stage
from lever.dataflow.messages import ExpandRequest, Expansion
from lever.dataflow.trace import Tracer
from lever.errors import LeverError
from lever.gguf.vocab_map import VocabMap
from lever.model import draws as llama
from lever.model.draws import Stream
from lever.model.finite import NonFiniteError, finite
from lever.model.grammar import Constraint
from lever.model.sampling import SamplingParams, distribution, draw_without_replacement
from lever.model.transformer import Model


def softmax_top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, vocab) logits -> (n, k) token ids by falling probability, and their probabilities.

    The top k are found on the logits; the softmax is needed only for its normalizer, in
    float32 (the probabilities are gains to rank nodes by, not a distribution to sample)."""
    z = np.asarray(logits, np.float32)
    try:
        # One pass in C: numpy's argpartition was a visible share of a draft forward
        # (docs/measurements.md, 'Draft top-k').
        top, top_z = native.top_k(z, k)
    except LeverError:
        if finite(z):
            raise
        raise NonFiniteError("logits") from None  # top_k skips NaN, and a row had fewer than k numbers
    m = top_z[:, :1]
    if not finite(m):  # an Inf is the row's top: z - m would make a NaN, with a warning printed
        raise NonFiniteError("logits")
    norm = np.exp(z - m).sum(axis=-1, keepdims=True)
    if not finite(norm):  # a NaN anywhere in a row makes its normalizer NaN: no pass of its own
        raise NonFiniteError("logits")
    return top, (np.exp(top_z - m) / norm).astype(np.float32)


# Below any logit a model computes, and finite: exp() of it minus the row's max underflows to 0
# silently, and the finite checks above still see only the model's own NaN and Inf.
MASKED_LOGIT = np.float32(-1e30)


def mapped_top_k(logits: np.ndarray, k: int, vocab: VocabMap) -> tuple[np.ndarray, np.ndarray]:
    """softmax_top_k over the draft tokens that have a target counterpart, in target ids: the
    others are masked first, so k real children come back (-1 pads only when fewer than k map).
    The probabilities are the draft's restricted to the mapped tokens. `logits` is overwritten."""
    if vocab.unmapped.size:
        logits[:, vocab.unmapped] = MASKED_LOGIT
    top, probs = softmax_top_k(logits, k)
    tokens = vocab.to_target[top]
    probs[tokens < 0] = 0.0  # a masked token, reached only when fewer than k map
    return tokens, probs


@attrs.define
class Drafter:
    """The synchronous core: a model, its cache, and the parents of this cycle's pending rows."""

    model: Model
    cache: KVCache
    n_committed: int = 0
    pending_parents: list[int] = attrs.field(factory=list)  # parent pending row of each pending row
    forwards: int = 0  # batched forwards run (for the run summary)
    forward_tokens: collections.Counter = attrs.field(factory=collections.Counter)  # tokens per forward -> forwards
    # the backend of forwards over several tokens ([placement] draft_batch); None: the CPU
    batch_layer_fn: Callable | None = None
    sampling: SamplingParams | None = None  # when the run samples: children are drawn from the draft's distribution
    rng: np.random.Generator = attrs.field(factory=np.random.default_rng)
    vocab: VocabMap | None = None  # the draft's ids are not the target's (lever.gguf.vocab_map); None: the same table
    constraint: Constraint | None = None  # a grammar on the generated text; None: free text
    constraint_start: int = 0  # the row of the first generated token (the prompt's rows are not constrained)
    pending_tokens: list[int] = attrs.field(factory=list)  # the token of each pending row (target ids)
    generated: list[int] = attrs.field(factory=list)  # committed tokens from constraint_start on, under a grammar
    # llama.cpp's draws the run's Accept takes (lever.model.draws); each row's first child is then the
    # token the draft's own chain draws with the number its position will take (a coupled proposal)
    coupled: Stream | None = None

    def keep(self, rows: tuple[int, ...], carry: tuple[int, ...] = ()) -> None:
        """A new cycle: of the pending rows, `rows` (ascending: the accepted path) join the
        committed prefix and `carry` (ascending, after them: a subtree drafted ahead) stay
        pending, renumbered from 0.

        The carried rows need no recomputing: they were drafted seeing the committed prefix,
        the kept path and their own ancestors, which is what they see from now on too."""
        new_index = {old: i for i, old in enumerate(carry)}
        parents = [new_index.get(self.pending_parents[old], -1) for old in carry]
        self.cache.keep_after(self.n_committed, np.asarray([*rows, *carry], np.int64))
        if self.constraint is not None:
            self.generated += [self.pending_tokens[r] for i, r in enumerate(rows)
                               if self.n_committed + i >= self.constraint_start]
        self.n_committed += len(rows)
        self.pending_parents = parents
        self.pending_tokens = [self.pending_tokens[old] for old in carry]

    def _ancestors(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(i)
            i = self.pending_parents[i]
        return out

    def expand(self, req: ExpandRequest) -> Expansion:
        if req.keep is not None:
            self.keep(req.keep, req.carry)
        n = req.tokens.size
        if n == 0:  # only rows kept: the next tree grew from rows drafted ahead
            empty = np.zeros((0, req.top_k))
            return Expansion(req.cycle, np.zeros(0, np.int32), empty.astype(np.int64), empty.astype(np.float32))
        first = len(self.pending_parents)
        depth = {-1: -1}
        for i in range(first):
            depth[i] = depth[self.pending_parents[i]] + 1
        pos = np.empty(n, np.int32)
        mask = np.zeros((n, self.cache.n_rows + n), bool)
        mask[:, : self.n_committed] = True
        for j in range(n):
            parent = int(req.parents[j])
            self.pending_parents.append(parent)
            self.pending_tokens.append(int(req.tokens[j]))
            row = first + j
            depth[row] = depth[parent] + 1
            pos[j] = self.n_committed + depth[row]
            mask[j, [self.n_committed + a for a in self._ancestors(row)]] = True
        batched = req.tokens.size > 1
        fed = req.tokens if self.vocab is None else self.vocab.to_draft[req.tokens]  # target ids -> the draft's
        try:
            hidden = self.model.forward(fed, pos, mask, self.cache, self.batch_layer_fn if batched else None)
        except NonFiniteError as e:
            raise e.evolve(role="draft", path=self.model.file.path) from None
        self.forwards += 1
        self.forward_tokens[n] += 1
        greedy = self.sampling is None or self.sampling.exact_match  # children by rank, none drawn
        n_seen = req.n_given if req.given_proposals and greedy else 0  # given rows whose top-k is asked
        expand = np.arange(req.n_given - n_seen, n)
        if expand.size == 0:
            empty = np.zeros((0, req.top_k))
            return Expansion(req.cycle, expand.astype(np.int32), empty.astype(np.int64), empty.astype(np.float32))
        logits = self.model.logits(hidden[expand])
        if greedy and self.sampling is not None and self.sampling.logit_bias:  # sampled: `draw`'s distribution adds it
            logits = self.sampling.logit_bias.apply(logits)
        dead = self._constrain(logits, first + expand, depth) if self.constraint is not None else None
        try:
            if greedy:
                if self.vocab is None:
                    tokens, probs = softmax_top_k(logits, req.top_k)
                else:
                    tokens, probs = mapped_top_k(logits, req.top_k, self.vocab)
                if self.coupled is not None and not self.sampling.greedy and self.vocab is None:
                    self._couple(logits, tokens, probs, [depth[first + int(e)] for e in expand])
                if dead is not None:  # a refused path: children of no weight, never grown
                    probs[dead] = 0.0
                rows = (first + expand[n_seen:]).astype(np.int32)
                given = (tokens[:n_seen], probs[:n_seen]) if n_seen else None
                return Expansion(req.cycle, rows, tokens[n_seen:], probs[n_seen:], given=given)
            return Expansion(req.cycle, (first + expand).astype(np.int32), *self.draw(logits, req.top_k, dead))
        except NonFiniteError:  # the failure path: which row, and which tensor of the head
            raise self.model.nonfinite_logits(logits, pos[expand], "draft") from None

    def _constrain(self, logits: np.ndarray, rows: np.ndarray, depth: dict[int, int]) -> np.ndarray:
        """Masks each row's logits (in place) by what the grammar allows after that pending
        row's path: the generated tokens committed, then its ancestors' and its own. Rows inside
        the prompt are left alone. Returns which rows' paths the grammar refused (no children)."""
        dead = np.zeros(len(rows), bool)
        for i, r in enumerate(rows):
            r = int(r)
            if self.n_committed + depth[r] < self.constraint_start - 1:
                continue  # a prompt position: what follows it is the prompt, not generated text
            path = [a for a in reversed(self._ancestors(r)) if self.n_committed + depth[a] >= self.constraint_start]
            allowed = self.constraint.mask([*self.generated, *(self.pending_tokens[a] for a in path)])
            if self.vocab is not None:  # the mask is over target ids; the logits over the draft's
                mapped = np.zeros(logits.shape[1], bool)
                mapped[self.vocab.mapped_draft] = allowed[self.vocab.mapped_target]
                allowed = mapped
            dead[i] = not allowed.any()
            logits[i, ~allowed[: logits.shape[1]]] = MASKED_LOGIT
        return dead

    def _couple(self, logits: np.ndarray, tokens: np.ndarray, probs: np.ndarray, depths: list[int]) -> None:
        """Each row's children (in place) led by the token the draft's chain draws with the
        number of llama.cpp's stream its child's position will take: where the two models
        agree, the target draws that very token (quantile coupling), far more often than it
        draws any one of the draft's likeliest. It takes rank 0 and the row's top weight."""
        s = self.sampling
        for i, d in enumerate(depths):
            g = self.n_committed + d + 1 - self.constraint_start  # the child's place among the generated tokens
            if g < 0:
                continue
            ids, w = llama.weights(logits[i], top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, temperature=s.temperature)
            t = llama.pick(ids, w, self.coupled.at(g))
            rest = [(int(x), float(q)) for x, q in zip(tokens[i], probs[i]) if x != t][: tokens.shape[1] - 1]
            probs[i] = [probs[i, 0], *(q for _, q in rest)]
            tokens[i] = [t, *(x for x, _ in rest)]

    def draw(self, logits: np.ndarray, k: int, dead: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                                         np.ndarray]:
        """Children drawn without replacement from the draft's distribution under the run's
        sampling parameters (so close to the target's): tokens (-1 pads), their probabilities, q.
        `dead` rows (a path a grammar refused) draw nothing."""
        q = np.stack([distribution(row, self.sampling) for row in logits]).astype(np.float32)
        if dead is not None:
            q[dead] = 0.0
        vocab = self.vocab
        if vocab is not None:
            # drawn from the draft's distribution restricted to the tokens that map, renormalized
            # (Accept's rejection sampling is exact for whatever q the draws really came from)
            q[:, vocab.unmapped] = 0.0
            mass = q.sum(axis=1, keepdims=True)
            q = np.divide(q, mass, out=np.zeros_like(q), where=mass > 0)  # no mass left: nothing drawn
        tokens = np.full((len(q), k), -1, np.int64)
        probs = np.zeros((len(q), k), np.float32)
        for i, row in enumerate(q):
            drawn = draw_without_replacement(row, k, self.rng)
            tokens[i, : drawn.size], probs[i, : drawn.size] = drawn, row[drawn]
        if vocab is None:
            return tokens, probs, q
        # ... and that q over the target's ids, zeros where no draft token maps (a one-to-one map:
        # the same numbers, other places)
        q_target = np.zeros((len(q), vocab.n_target), np.float32)
        q_target[:, vocab.mapped_target] = q[:, vocab.mapped_draft]
        return np.where(tokens >= 0, vocab.to_target[np.maximum(tokens, 0)], -1), probs, q_target


@attrs.frozen
class DraftStats:
    """The draft's figures over a run."""

    weights_bytes: int  # the resident draft model
    kv_cache_bytes: int
    forwards: int  # batched forwards run
    forward_tokens: dict[int, int]  # tokens in a forward -> how many forwards had that many


@attrs.define
class Draft(Stage):
    """ExpandRequest -> Expansion."""

    name: str
    core: Drafter
    slot: ComputeSlot | None = None  # the compute slot, shared with the target's layers
    tracer: Tracer = attrs.field(factory=lambda: Tracer(enabled=False))
    ahead_threads: int = 1  # kernel threads when drafting ahead: leave the other cores to the pass it overlaps
    INPUTS = {"expand": ExpandRequest}
    OUTPUTS = {"expansion": Expansion}

    def stats(self) -> DraftStats:
        c = self.core
        return DraftStats(c.model.nbytes, c.cache.nbytes, c.forwards, dict(sorted(c.forward_tokens.items())))

    def _expand(self, req: ExpandRequest) -> Expansion:
        with self.tracer.span(self.name, f"draft c{req.cycle}", batch=int(req.tokens.size)):  # not the wait for a slot
            if not req.ahead:
                return self.core.expand(req)
            own_cores = self.slot is not None and self.slot.ahead_cores
            n_threads = self.slot.threads(AHEAD) if own_cores else self.ahead_threads
            with native.threads(n_threads):
                return self.core.expand(req)

    async def run(self, inputs, outputs):
        async for req in inputs["expand"]:
            exp = await run_on(self.slot, AHEAD if req.ahead else DRAFT, self._expand, req)
            await outputs["expansion"].send(exp)
