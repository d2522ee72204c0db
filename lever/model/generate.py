"""Autoregressive generation with one memory-resident model: prefill, then one token a pass.

This is the reference every pipeline is held to: a speculative pipeline's greedy output must
equal `generate`'s greedy output token for token. Prefill runs the prompt in chunks (the
kernels are batch-invariant, so the chunk size changes speed, never the result). Logits
holding a NaN or an Inf end it with one line naming the file and the position, not a token 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import numpy as np

from lever.backends.cpu.kv_cache import causal_mask
from lever.errors import LeverError
from lever.model.sampling import SamplingParams, sample
from lever.model.stop import StopReason, stop_reason
from lever.model.transformer import Model

PREFILL_CHUNK = 64  # tokens per prefill pass: large enough to amortize weight reads


@attrs.frozen
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]  # generated ids, without the prompt
    prefill_s: float
    decode_s: float
    stop_reason: StopReason  # EOS, LENGTH or CONTEXT

    @property
    def decode_tps(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 and len(self.tokens) > 1 else 0.0

    @property
    def prefill_tps(self) -> float:
        return len(self.prompt_tokens) / self.prefill_s if self.prefill_s > 0 else 0.0


def prefill(model: Model, cache, tokens: list[int], chunk: int = PREFILL_CHUNK) -> np.ndarray:
    """Runs the prompt into the cache; returns the hidden state of its last token (n_embd,)."""
    hidden = None
    for start in range(0, len(tokens), chunk):
        ids = np.asarray(tokens[start : start + chunk], np.int64)
        n_past = cache.n_rows
        pos = np.arange(n_past, n_past + ids.size, dtype=np.int32)
        hidden = model.forward(ids, pos, causal_mask(n_past, ids.size), cache)
    return hidden[-1]


GREEDY = SamplingParams()


def generate(model: Model, prompt_tokens: list[int], n_predict: int, params: SamplingParams = GREEDY,
             n_ctx: int | None = None, eos_ids: frozenset[int] = frozenset(),
             on_token: Callable[[int], None] | None = None) -> GenerationResult:
    n_ctx = n_ctx or model.spec.n_ctx_train
    if not prompt_tokens:
        raise LeverError("empty prompt: give at least one token (or let the tokenizer add BOS)")
    if len(prompt_tokens) > n_ctx:
        raise LeverError(f"prompt is {len(prompt_tokens)} tokens, over the context of {n_ctx}")
    params.logit_bias.check(model.spec.n_vocab)
    cache = model.new_cache(n_ctx)
    rng = params.rng()

    t0 = time.perf_counter()
    last = prefill(model, cache, prompt_tokens)
    logits = model.logits(last[None])[0]
    model.check_logits(logits[None], [len(prompt_tokens) - 1])
    t1 = time.perf_counter()

    out: list[int] = []
    stop = StopReason.LENGTH
    while len(out) < n_predict:
        # the logit bias and the penalties over the text so far, as Accept applies them at every node
        tok = sample(logits, params, rng, (*prompt_tokens, *out) if params.penalizes else ())
        out.append(tok)
        if on_token:
            on_token(tok)
        # the rule Accept ends a pipeline's generation by (the row for `tok` is not in the cache yet)
        reason = stop_reason(tok, n_emitted=len(out), n_predict=n_predict, n_rows=cache.n_rows, n_ctx=n_ctx,
                             eos_ids=eos_ids)
        if reason is not None:
            stop = reason
            break
        n_past = cache.n_rows
        hidden = model.forward(np.array([tok]), np.array([n_past], np.int32), causal_mask(n_past, 1), cache)
        logits = model.logits(hidden)[0]
        model.check_logits(logits[None], [n_past])  # one max over the row (the forward checked its hidden state)
    t2 = time.perf_counter()
    return GenerationResult(list(prompt_tokens), out, t1 - t0, t2 - t1, stop)
