"""Turning a row of logits into the next token: greedy, or sampled through llama.cpp's chain.

Generation and the Accept stage share these functions, so the distribution that speculative
sampling preserves is exactly the one autoregressive sampling draws from. The logits are shaped
and cut as llama.cpp's sampler chain does it: the logit bias first, then the penalties on the
tokens of the text before the position (repeat, frequency, presence), so a node of a tree and
the same position decoded one token at a time see the same row; then top-k, top-p, min-p, the
temperature (lever.model.draws), so a knob means what it means to llama.cpp. How a sampled
token is drawn is `draws`: "llama.cpp" takes llama.cpp's own draws from the seed, one per token,
so the text is autoregressive decoding's with that seed, token for token, whatever the tree
(and llama.cpp's, where the logits agree); "rejection" draws the draft's children and keeps the
target's distribution by rejection sampling (the draws then depend on the tree). Logits
holding a NaN or an Inf end the run (lever.model.finite.NonFiniteError, which the caller
completes with the model and the position); a temperature so small that the logits over it
overflow draws from the limit, the likeliest tokens.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import attrs
import numpy as np

from lever.errors import LeverError
from lever.model import draws as llama
from lever.model.finite import NonFiniteError


@attrs.frozen
class Range:
    """The values a sampling or generation argument may take, one table for the config, the API,
    the server and every command's flags, so all of them accept and refuse the same values."""

    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False  # (lo, hi] rather than [lo, hi]

    def problem(self, value) -> str | None:
        """None when `value` is in range, else "must be ..., got ..." (NaN and inf are never in
        range: every bound here is finite)."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or (
                self.integer and not (isinstance(value, numbers.Integral) or
                                      (math.isfinite(value) and float(value).is_integer()))):
            return f"must be {'an integer' if self.integer else 'a number'}, got {value!r}"
        ok = (self.lo < value if self.lo_open else self.lo <= value) and value <= self.hi
        if ok:
            return None
        return f"must be {'an integer' if self.integer else 'a finite number'} in {self.describe()}, got {value!r}"

    def describe(self) -> str:
        fmt = lambda x: f"{int(x)}" if self.integer else f"{x:g}"  # noqa: E731
        return f"{'(' if self.lo_open else '['}{fmt(self.lo)}, {fmt(self.hi)}]"


# Bounds wider than any use and narrow enough that nothing downstream overflows: a temperature
# above 100 is a uniform draw, a penalty outside [1e-3, 1e3] flattens or erases the logits it
# touches, top_k fits an int32, the seed an int64 (TOML's integers; -1 asks for a fresh seed).
SEED_FRESH = -1
LIMITS = {
    "temperature": Range(0.0, 100.0),
    "top_k": Range(0, 2**31 - 1, integer=True),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "min_p": Range(0.0, 1.0),
    "repeat_penalty": Range(1e-3, 1e3),
    "repeat_last_n": Range(0, 2**20, integer=True),
    "presence_penalty": Range(-1e3, 1e3),
    "frequency_penalty": Range(-1e3, 1e3),
    "seed": Range(SEED_FRESH, 2**63 - 1, integer=True),
}


def check_limit(name: str, value, where: str | None = None) -> None:
    """One line naming `where` (the flag, key or argument; default the field) when `value` is
    outside LIMITS[name]."""
    problem = LIMITS[name].problem(value)
    if problem is not None:
        raise LeverError(f"{where or name}: {problem}")


def _fresh_seed(seed):
    return None if seed == SEED_FRESH else seed  # -1 is the config's "fresh seed", as None is here


# A bias past a million moves a logit further than any model's range (a few dozen) and keeps float32
# logits far from overflow; -inf (JSON's false) bans the token. The tokens biased are bounded as a
# request's stop strings are: enough for any list of words, few enough to add to every row at once.
BIAS = Range(-1e6, 1e6)
NEVER = -math.inf
MAX_LOGIT_BIAS = 4096
PAIR_BYTES = 160  # a pair held in Python (its tuple, int and float, its place in the tuple) and merged, at most
MAX_TOKEN_ID = 2**31 - 1  # llama.cpp's token ids are int32


def _token_id(key) -> int:
    if isinstance(key, str) and key.isascii() and key.isdigit():  # JSON's object keys are strings
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, numbers.Integral) or not 0 <= key <= MAX_TOKEN_ID:
        raise LeverError(f"logit_bias: a token id must be an integer in [0, {MAX_TOKEN_ID}], got {key!r:.40}")
    return int(key)


def _bias(value) -> float:
    if value is False or (isinstance(value, numbers.Real) and value == NEVER):
        return NEVER
    problem = BIAS.problem(value)
    if problem is not None:
        raise LeverError(f"logit_bias: a bias {problem} (or false / -inf: never)")
    return float(value)


def _pairs(value) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs from [[id, bias], ...] or {id: bias} (an id may be a string of digits, as
    JSON's object keys are); a bias is a number in BIAS, or false or -inf: never."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
        bad = next((e for e in items if not isinstance(e, (list, tuple)) or len(e) != 2), None)
        if bad is not None:
            raise LeverError(f"logit_bias: each entry is a [token id, bias] pair, got {bad!r:.40}")
    else:
        raise LeverError(f"logit_bias: must be a list of [token id, bias] pairs or an object {{token id: bias}}, "
                         f"got {type(value).__name__}")
    if len(items) > MAX_LOGIT_BIAS:
        raise LeverError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(items)}")
    return tuple((_token_id(k), _bias(b)) for k, b in items)


@attrs.frozen
class LogitBias:
    """Token id -> a bias added to its logit before anything else (llama.cpp's logit_bias; -inf:
    never chosen). The pairs as given: a token given twice gets both, one after the other, as
    llama.cpp adds them."""

    pairs: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_pairs)
    ids: np.ndarray = attrs.field(init=False, eq=False, repr=False)  # the pairs' ids, int64
    values: np.ndarray = attrs.field(init=False, eq=False, repr=False)  # and their biases, float64

    def __attrs_post_init__(self):
        object.__setattr__(self, "ids", np.fromiter((i for i, _ in self.pairs), np.int64, len(self.pairs)))
        object.__setattr__(self, "values", np.fromiter((b for _, b in self.pairs), np.float64, len(self.pairs)))

    @classmethod
    def of(cls, value) -> LogitBias:
        return value if isinstance(value, LogitBias) else cls(value)

    def __bool__(self) -> bool:
        return bool(self.pairs)

    @property
    def nbytes(self) -> int:
        """What it holds, at most (a server counts a call's memory by it)."""
        return PAIR_BYTES * len(self.pairs)

    def banning(self, ids) -> LogitBias:
        """These pairs, then each of `ids` never (llama-server's ignore_eos: the end tokens)."""
        return LogitBias((*self.pairs, *((int(i), NEVER) for i in sorted(ids))))

    def check(self, n_vocab: int) -> None:
        """One line when a token is past the vocabulary, or when no token is left to choose."""
        if self.ids.size and int(self.ids.max()) >= n_vocab:
            raise LeverError(f"logit_bias: token id {int(self.ids.max())} is not in the vocabulary of {n_vocab}")
        if np.unique(self.ids[self.values == NEVER]).size >= n_vocab:
            raise LeverError(f"logit_bias: bans every token of the vocabulary of {n_vocab}")

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (..., n_vocab) with the biases added in turn, in the logits' precision (float32:
        llama.cpp's sums): a copy."""
        out = np.array(logits, copy=True)
        np.add.at(out, (..., self.ids), self.values.astype(out.dtype))
        return out


# how a sampled token is drawn (SamplingParams.draws): llama.cpp's draws from the seed, the same
# whatever the tree; or the draft's children drawn and the target's distribution kept by rejection
DRAWS = ("llama.cpp", "rejection")


@attrs.frozen
class SamplingParams:
    """temperature 0 means greedy (argmax; ties go to the lowest id). Every field is checked
    against LIMITS, the same bounds the config, the API and the commands apply."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = attrs.field(default=None, converter=_fresh_seed)  # None (or -1): a fresh seed
    min_p: float = 0.0  # 0: no cut; else tokens below min_p x the likeliest token's probability are dropped
    repeat_penalty: float = 1.0  # 1: off; else the last `repeat_last_n` tokens' logits are pushed down (llama.cpp's)
    repeat_last_n: int = 64  # how many of the latest tokens the penalties look at
    presence_penalty: float = 0.0  # 0: off; else taken once from the logit of each of those tokens (OpenAI's)
    frequency_penalty: float = 0.0  # 0: off; else taken from it once per time the token is among them
    logit_bias: LogitBias = attrs.field(factory=LogitBias, converter=LogitBias.of)  # before the penalties
    draws: str = attrs.field(default="llama.cpp", validator=attrs.validators.in_(DRAWS))  # how a sample is drawn

    def __attrs_post_init__(self):
        for name in LIMITS:
            value = getattr(self, name)
            if value is not None or name != "seed":
                check_limit(name, value, name.replace("_", "-"))

    @property
    def penalizes(self) -> bool:
        """The text before a position changes its logits: a penalty is on."""
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                           or self.frequency_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def exact_match(self) -> bool:
        """The target chooses each token itself (greedy, or llama.cpp's draws) and a tree is kept
        along the child holding it: proposals need no draft distribution, and any source may propose."""
        return self.greedy or self.draws == "llama.cpp"

    def rng(self) -> np.random.Generator | llama.Stream:
        """A generation's random numbers: llama.cpp's stream from the seed (a fresh seed: one
        drawn from the system), or numpy's generator for rejection draws."""
        if self.draws == "llama.cpp":
            return llama.Stream(self.seed if self.seed is not None else int(np.random.SeedSequence().entropy))
        return np.random.default_rng(self.seed)


def penalize(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """The logits shaped as llama.cpp's sampler chain shapes them before its cuts: the logit bias
    added, then the penalties on each distinct token among the last `repeat_last_n` of `history`
    (the text before this position), c times there: a positive logit divided by the repeat
    penalty, a negative one multiplied, then c x frequency_penalty + presence_penalty taken off.
    A copy when anything is done; `logits` itself is untouched."""
    shaped = params.penalizes and len(history) > 0
    if not shaped and not params.logit_bias:
        return logits
    out = params.logit_bias.apply(logits) if params.logit_bias else logits.copy()
    if shaped:  # in the logits' precision, as llama.cpp computes in float
        seen, counts = np.unique(np.asarray(history[-params.repeat_last_n :], np.int64), return_counts=True)
        f = out.dtype.type
        x = out[seen]
        x = np.where(x > 0, x / f(params.repeat_penalty), x * f(params.repeat_penalty))
        out[seen] = x - (counts.astype(out.dtype) * f(params.frequency_penalty) + f(params.presence_penalty))
    return out


def distribution(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """The probabilities (n_vocab,) float64 that sampling draws from: the shaped logits through
    llama.cpp's cuts and temperature (lever.model.draws), normalized."""
    x = penalize(logits, params, history)
    if not math.isfinite(float(x.max())):  # a NaN anywhere makes the max NaN
        raise NonFiniteError("logits")
    ids, w = llama.weights(x, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                           temperature=params.temperature)
    p = np.zeros(x.shape[-1])
    p[ids] = w.astype(np.float64) / float(np.sum(w, dtype=np.float64))
    return p


def sample(logits: np.ndarray, params: SamplingParams, rng, history: Sequence[int] = ()) -> int:
    """The token at one position (`rng`: the generation's, SamplingParams.rng)."""
    if params.greedy:
        return int(np.argmax(penalize(logits, params, history)))
    if params.draws == "llama.cpp":
        x = penalize(logits, params, history)
        if not math.isfinite(float(x.max())):
            raise NonFiniteError("logits")
        return llama.draw(x, rng, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                          temperature=params.temperature)
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
