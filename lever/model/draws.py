"""llama.cpp's draws: its sampler chain and its random stream, so a seed gives llama.cpp's text.

Below lever.model.sampling's callers (generate, Accept): with [generate] draws = "llama.cpp" a
sampled token is chosen as llama.cpp's default sampler chain chooses it (common/sampling.cpp:
the logit bias and penalties, then top-k, top-p, min-p, temperature, then `dist`), drawing from
the stream `std::mt19937(seed)` feeds `std::uniform_real_distribution<double>` in libstdc++.
Each emitted token takes exactly one draw, in the order the tokens are emitted, so a tree walk
(stages/accept.py) that chooses each node's token this way and descends into the child holding
it emits what autoregressive decoding with the same seed emits, token for token: the draws are
the same, not only their distribution, whatever the tree, the batch or the thread count.

The arithmetic is llama.cpp's where it decides a token: float32 logits and probabilities,
sequential float32 sums where it sums in float (top-p), a double sum where it sums in double
(`dist`), the candidates in the order it leaves them (sorted after top-k or top-p; min-p on an
unsorted array keeps token order). Ties in a sort go to the lower id (llama.cpp's partial sort
leaves them unspecified; logits that tie exactly are rare past the smallest models).
"""

from __future__ import annotations

import threading

import numpy as np

# std::generate_canonical<double, 53> over a 32-bit engine takes two outputs: (a + b * 2^32) / 2^64
TWO_32, TWO_64 = float(2**32), float(2**64)
BELOW_ONE = float(np.nextafter(1.0, 0.0))


class Stream:
    """std::mt19937 seeded as llama.cpp seeds its sampler, and the doubles its `dist` draws.
    numpy's MT19937 with the legacy seeding is the same generator (init_genrand). The numbers
    are kept by index, so the draft can see the one a position will take before Accept takes it
    (a coupled proposal: stages/draft.py) without moving the stream."""

    def __init__(self, seed: int):
        self._mt = np.random.MT19937()
        self._mt._legacy_seeding(int(seed) & 0xFFFFFFFF)  # llama.cpp's seed is a uint32_t
        self._made: list[float] = []
        self._lock = threading.Lock()  # the draft (drafting ahead, in its thread) reads ahead too
        self.n_draws = 0

    def raw(self, n: int) -> np.ndarray:
        """The engine's next n 32-bit outputs (for tests: bypasses the numbers kept)."""
        return self._mt.random_raw(n)

    def at(self, j: int) -> float:
        """The j-th number (0-based) the stream gives: std::uniform_real_distribution<double>(0, 1),
        that is generate_canonical<double, 53> of the engine's next two outputs."""
        with self._lock:
            while len(self._made) <= j:
                a, b = (int(x) for x in self._mt.random_raw(2))
                u = (a + b * TWO_32) / TWO_64
                self._made.append(u if u < 1.0 else BELOW_ONE)
            return self._made[j]

    def uniform(self) -> float:
        """The next number, taken."""
        u = self.at(self.n_draws)
        self.n_draws += 1
        return u


def candidates(logits: np.ndarray, *, top_k: int, top_p: float, min_p: float,
               temperature: float) -> tuple[np.ndarray, np.ndarray, bool]:
    """llama.cpp's chain from top-k to the temperature: the token ids left, their logits
    (float32, divided by the temperature) in the order llama.cpp leaves them, and whether that
    order is sorted (descending)."""
    x = np.asarray(logits, np.float32)
    ids = np.arange(x.size)
    ordered = False
    if top_k > 0:
        ids, x = _sorted(ids, x, min(top_k, x.size))
        ordered = True
    if top_p < 1.0:
        if not ordered:
            ids, x = _sorted(ids, x, x.size)
            ordered = True
        p = np.exp(x - x[0], dtype=np.float32)
        p = p / np.cumsum(p, dtype=np.float32)[-1]  # llama.cpp sums in float, one after another
        reached = np.flatnonzero(np.cumsum(p, dtype=np.float32) >= np.float32(top_p))
        n = int(reached[0]) + 1 if reached.size else x.size
        ids, x = ids[:n], x[:n]
    if min_p > 0.0:
        floor = np.float32(x.max() + np.float32(np.log(np.float32(min_p))))
        if ordered:  # the first always stays; then up to the first one under the floor
            under = np.flatnonzero(x[1:] < floor)
            n = int(under[0]) + 1 if under.size else x.size
            ids, x = ids[:n], x[:n]
        else:
            keep = x >= floor
            ids, x = ids[keep], x[keep]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # an overflow: `weights` takes the limit
        return ids, (x / np.float32(temperature)).astype(np.float32), ordered


def _sorted(ids: np.ndarray, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest, descending (ties to the lower id)."""
    top = np.argpartition(-x, k - 1)[:k] if k < x.size else np.arange(x.size)
    top = top[np.lexsort((ids[top], -x[top]))]
    return ids[top], x[top]


def weights(logits: np.ndarray, *, top_k: int, top_p: float, min_p: float,
            temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The candidates llama.cpp's chain leaves and their unnormalized probabilities as its
    `dist` computes them (float32 exp of each tempered logit less the largest), in its order.
    A temperature so small that the largest logit over it overflows leaves the limit as the
    temperature goes to 0: the likeliest candidates, equally."""
    ids, x, _ = candidates(logits, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    hi = x.max()
    if not np.isfinite(hi):
        top = np.asarray(logits, np.float32)[ids]
        return ids, (top == top.max()).astype(np.float32)
    with np.errstate(under="ignore"):
        return ids, np.exp(x - hi, dtype=np.float32)


def pick(ids: np.ndarray, w: np.ndarray, u: float) -> int:
    """`dist`'s choice among candidates `ids` of weights `w` (`weights`) for the number u."""
    run = np.cumsum(w.astype(np.float64))  # its running sum is a double
    i = int(np.searchsorted(run, run[-1] * u, side="left"))  # the first whose sum reaches the target
    return int(ids[min(i, ids.size - 1)])


def draw(logits: np.ndarray, stream: Stream, *, top_k: int, top_p: float, min_p: float,
         temperature: float) -> int:
    """One sampled token as llama.cpp's chain and `dist` choose it from `logits` (already
    biased and penalized: lever.model.sampling.penalize), taking one draw from `stream`."""
    ids, w = weights(logits, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    return pick(ids, w, stream.uniform())  # taken even for one candidate, as llama.cpp does
