"""Accept's walk along the target's choices, with a fake lm_head."""

from __future__ import annotations

import numpy as np

from lever.messages import TokenTree
from lever.sampling import SamplingParams
from lever.stages.accept import accept_tree

VOCAB = 50


def logits_choosing(choice: dict[int, int]):
    """lm_head stand-in: hidden row i holds its node index; the target picks choice[node]."""
    calls = []

    def fn(rows):
        calls.append(len(rows))
        out = np.zeros((len(rows), VOCAB), np.float32)
        for r, h in enumerate(rows):
            out[r, choice[int(h[0])]] = 1.0
        return out

    return fn, calls


def tree():
    # root 0 -> children 1 (tok 7) and 2 (tok 8); 1 -> 3 (tok 9); 2 -> 4 (tok 3)
    return TokenTree(1, np.array([5, 7, 8, 9, 3]), np.array([-1, 0, 0, 1, 2], np.int32))


def hidden():
    return np.arange(5, dtype=np.float32)[:, None]


def test_descends_along_matches_then_emits_the_bonus():
    fn, calls = logits_choosing({0: 8, 2: 3, 4: 11})
    toks, keep, rows = accept_tree(tree(), hidden(), fn, SamplingParams(), np.random.default_rng(0), 100, frozenset())
    assert toks == [8, 3, 11] and keep == [0, 2, 4] and rows == 3 and calls == [1, 1, 1]


def test_first_miss_stops_with_the_targets_token():
    fn, _ = logits_choosing({0: 30})
    toks, keep, rows = accept_tree(tree(), hidden(), fn, SamplingParams(), np.random.default_rng(0), 100, frozenset())
    assert toks == [30] and keep == [0] and rows == 1


def test_budget_and_eos_stop_the_walk():
    fn, _ = logits_choosing({0: 7, 1: 9, 3: 1})
    assert accept_tree(tree(), hidden(), fn, SamplingParams(), np.random.default_rng(0), 1, frozenset())[0] == [7]
    assert accept_tree(tree(), hidden(), fn, SamplingParams(), np.random.default_rng(0), 9, frozenset({7}))[0] == [7]
