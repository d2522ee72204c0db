"""Accept's walk along the target's choices, with a fake lm_head."""

from __future__ import annotations

import numpy as np

from lever.messages import TokenTree
from lever.sampling import SamplingParams
from lever.stages.accept import accept_tree

VOCAB = 50


def logits_choosing(choice: dict[int, int]):
    """lm_head stand-in: the target picks choice[node] at each node; records each batch."""
    calls = []

    def fn(nodes):
        calls.append(list(nodes))
        out = np.zeros((len(nodes), VOCAB), np.float32)
        for r, node in enumerate(nodes):
            out[r, choice.get(node, 0)] = 1.0
        return out

    return fn, calls


def tree():
    # root 0 -> children 1 (tok 7, likelier) and 2 (tok 8); 1 -> 3 (tok 9); 2 -> 4 (tok 3)
    return TokenTree(1, np.array([5, 7, 8, 9, 3]), np.array([-1, 0, 0, 1, 2], np.int32),
                     draft_probs=np.array([1.0, 0.6, 0.3, 0.5, 0.2], np.float32))


def walk(choice, budget=100, eos=frozenset()):
    fn, calls = logits_choosing(choice)
    return (*accept_tree(tree(), fn, SamplingParams(), np.random.default_rng(0), budget, eos), calls)


def test_the_likely_path_goes_in_one_batch():
    toks, keep, rows, calls = walk({0: 7, 1: 9, 3: 11})
    assert toks == [7, 9, 11] and keep == [0, 1, 3] and rows == 3 and calls == [[0, 1, 3]]


def test_leaving_the_likely_path_starts_a_batch_at_the_fork():
    toks, keep, rows, calls = walk({0: 8, 2: 3, 4: 11})
    assert toks == [8, 3, 11] and keep == [0, 2, 4]
    assert calls == [[0, 1, 3], [2, 4]] and rows == 5  # rows 1 and 3 were computed in vain


def test_first_miss_stops_with_the_targets_token():
    toks, keep, _, _ = walk({0: 30})
    assert toks == [30] and keep == [0]


def test_budget_and_eos_stop_the_walk():
    toks, _, rows, calls = walk({0: 7, 1: 9, 3: 1}, budget=1)
    assert toks == [7] and calls == [[0]] and rows == 1  # no row past what may still be emitted
    assert walk({0: 7, 1: 9, 3: 1}, budget=9, eos=frozenset({7}))[0] == [7]
