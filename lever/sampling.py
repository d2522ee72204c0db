"""Turning a row of logits into the next token: greedy, or temperature / top-k / top-p sampling.

Generation and the Accept stage share these functions, so the distribution that speculative
sampling preserves is exactly the one autoregressive sampling draws from.
"""

from __future__ import annotations

import attrs
import numpy as np

from lever.errors import LeverError


@attrs.frozen
class SamplingParams:
    """temperature 0 means greedy (argmax; ties go to the lowest id)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None

    def __attrs_post_init__(self):
        if self.temperature < 0:
            raise LeverError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LeverError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LeverError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities (n_vocab,) float64 that sampling draws from, after all cuts."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(cum, params.top_p)) + 1  # smallest set reaching top_p
        cut = np.zeros_like(p)
        cut[order[:n_keep]] = p[order[:n_keep]]
        p = cut / cut.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    p = distribution(logits, params)
    return int(rng.choice(p.size, p=p))
