"""A draft model's stand-in for tree tests: numbered rows and fixed proposals, no model."""

from __future__ import annotations

import numpy as np

from lever.dataflow.messages import Expansion


class FakeDraft:
    """Numbers pending rows as the real Draft does; every expanded node proposes tokens
    10..10+k with probability p_first for the first and a flat rest for the others."""

    def __init__(self, p_first: float = 0.7):
        self.p_first, self.n_pending = p_first, 0

    def __call__(self, req) -> Expansion:
        if req.keep is not None:
            self.n_pending = len(req.carry)  # carried rows stay pending, renumbered from 0
        first = self.n_pending + req.n_given
        self.n_pending += req.tokens.size
        n, k = req.tokens.size - req.n_given, req.top_k
        rest = (1 - self.p_first) / max(k - 1, 1)
        probs = np.array([[self.p_first] + [rest] * (k - 1)] * n, np.float32)
        tokens = np.tile(np.arange(10, 10 + k, dtype=np.int64), (n, 1))
        return Expansion(req.cycle, np.arange(first, first + n, dtype=np.int32), tokens, probs)
