"""Turning a row of logits into the next token: greedy, or temperature / top-k / top-p sampling.

Generation and the Accept stage share these functions, so the distribution that speculative
sampling preserves is exactly the one autoregressive sampling draws from. Logits holding a NaN
or an Inf end the run (lever.model.finite.NonFiniteError, which the caller completes with the
model and the position); a temperature so small that the logits over it overflow float64 draws
from the limit, the likeliest tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from lever.errors import LeverError
from lever.model.finite import NonFiniteError


@attrs.frozen
class SamplingParams:
    """temperature 0 means greedy (argmax; ties go to the lowest id)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None
    min_p: float = 0.0  # 0: no cut; else tokens below min_p x the likeliest token's probability are dropped
    repeat_penalty: float = 1.0  # 1: off; else the logits of the last `repeat_last_n` tokens are pushed down (llama.cpp's)
    repeat_last_n: int = 64  # how many of the latest tokens the penalty looks at

    def __attrs_post_init__(self):
        if self.temperature < 0:
            raise LeverError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LeverError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LeverError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise LeverError(f"min-p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise LeverError(f"repeat penalty must be a finite number > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise LeverError(f"repeat-last-n must be >= 0, got {self.repeat_last_n}")

    @property
    def penalizes(self) -> bool:
        return self.repeat_penalty != 1.0 and self.repeat_last_n > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def penalize(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """The logits with the repeat penalty applied, as llama.cpp does: each distinct token of the
    last `repeat_last_n` of `history` (the text before this position) has a positive logit
    divided by the penalty, a negative one multiplied. A copy; `logits` itself is untouched."""
    if not params.penalizes or not len(history):
        return logits
    seen = np.unique(np.asarray(history[-params.repeat_last_n :], np.int64))
    out = logits.copy()
    x = out[seen]
    out[seen] = np.where(x > 0, x / params.repeat_penalty, x * params.repeat_penalty)
    return out


def distribution(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """The probabilities (n_vocab,) float64 that sampling draws from, after all cuts."""
    x = penalize(logits, params, history)
    hi, lo = float(x.max()), float(x.min())  # a NaN anywhere makes the max NaN
    if not math.isfinite(hi):
        raise NonFiniteError("logits")
    if max(abs(hi), abs(lo) if math.isfinite(lo) else 0.0) > params.temperature * FLOAT64_MAX:
        return _overflowed(x, hi, params)
    z = x.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.min_p > 0.0:  # after temperature, as llama.cpp's sampler chain applies it
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(cum, params.top_p)) + 1  # smallest set reaching top_p
        cut = np.zeros_like(p)
        cut[order[:n_keep]] = p[order[:n_keep]]
        p = cut / cut.sum()
    return p


FLOAT64_MAX = float(np.finfo(np.float64).max)


def _overflowed(x: np.ndarray, hi: float, params: SamplingParams) -> np.ndarray:
    """`distribution` when a logit over the temperature overflows float64: if the largest does,
    the limit as the temperature goes to 0, the likeliest tokens alone and equally (what every
    cut leaves as it is); if only negative ones do, the same sum with their -Inf (probability 0)."""
    if abs(hi) > params.temperature * FLOAT64_MAX:
        top = (x == hi).astype(np.float64)
        return top / top.sum()
    with np.errstate(over="ignore"):  # the overflow gives -Inf, the right logit: no warning to print
        z = x.astype(np.float64) / params.temperature
    return distribution(z, attrs.evolve(params, temperature=1.0, repeat_penalty=1.0))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, history: Sequence[int] = ()) -> int:
    if params.greedy:
        return int(np.argmax(penalize(logits, params, history)))
    p = distribution(logits, params, history)
    return int(rng.choice(p.size, p=p))


def draw_without_replacement(q: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k tokens drawn one after another from q (n_vocab,) without replacement (Gumbel-top-k:
    the order is the order of the draws); fewer when q has fewer than k tokens of mass."""
    with np.errstate(divide="ignore"):
        keys = np.log(q.astype(np.float64)) + rng.gumbel(size=q.size)
    k = min(k, int(np.count_nonzero(q)))
    top = np.argpartition(-keys, k - 1)[:k] if k else np.zeros(0, np.int64)
    return top[np.argsort(-keys[top], kind="stable")].astype(np.int64)


def rejection_sample(p: np.ndarray, drawn, q: np.ndarray | None, rng: np.random.Generator) -> tuple[int, int]:
    """The target's token at a tree node whose draft children were `drawn`: multi-candidate
    speculative sampling (SpecInfer), in its recursive form for draws without replacement.

    p is the target's distribution; `drawn` the draft's tokens in the order they were drawn
    from q without replacement (q None: chosen deterministically, point masses). Each is
    accepted with probability min(1, r(x) / q'(x)), r the target's residual so far and q' the
    draft's distribution over what was not drawn yet; on a rejection the residual becomes
    norm(max(r - q', 0)). Whatever the draft, the token returned is distributed exactly as p.
    Returns (token, index into drawn, or -1 when every draft token was rejected).
    """
    r = np.asarray(p, np.float64)
    left = None if q is None else np.asarray(q, np.float64).copy()
    for j, x in enumerate(drawn):
        q_x = 1.0 if left is None else left[x] / left.sum()
        if rng.random() * q_x < r[x]:
            return int(x), j
        if left is None:  # a point mass: the residual is r without x
            r = r.copy()
            r[x] = 0.0
        else:
            r = np.maximum(r - left / left.sum(), 0.0)
            left[x] = 0.0
        mass = r.sum()
        if mass <= 0.0:  # r was q' up to rounding, so x was in fact certain to be accepted
            return int(x), j
        r /= mass
    return int(rng.choice(r.size, p=r)), -1
