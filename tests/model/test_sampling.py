"""Greedy and sampled token choice: the distribution after temperature, top-k and top-p."""

import numpy as np
import pytest

from lever.errors import LeverError
from lever.model.sampling import SamplingParams, distribution, sample


def test_greedy_is_argmax_lowest_on_ties():
    logits = np.array([0.1, 3.0, 3.0, -1.0], np.float32)
    assert sample(logits, SamplingParams(), np.random.default_rng(0)) == 1


def test_temperature_scales_softmax():
    logits = np.log(np.array([0.5, 0.25, 0.25]))
    p = distribution(logits, SamplingParams(temperature=1.0))
    assert np.allclose(p, [0.5, 0.25, 0.25])
    p2 = distribution(logits, SamplingParams(temperature=0.5))
    assert np.allclose(p2, np.array([0.25, 0.0625, 0.0625]) / 0.375)


def test_top_k_and_top_p_cut():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert np.allclose(distribution(logits, SamplingParams(1.0, top_k=2)), [4 / 7, 3 / 7, 0, 0])
    # top-p 0.65: 0.4 + 0.3 reaches it, 0.2 and 0.1 are cut
    assert np.allclose(distribution(logits, SamplingParams(1.0, top_p=0.65)), [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(distribution(logits, SamplingParams(1.0, top_p=0.75)), [4 / 9, 3 / 9, 2 / 9, 0])


def test_min_p_cuts_below_a_share_of_the_likeliest():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    # min-p 0.25: the bar is 0.125, so 0.05 goes and the rest keep their proportions
    assert np.allclose(distribution(logits, SamplingParams(1.0, min_p=0.25)), np.array([0.5, 0.3, 0.15, 0]) / 0.95)
    assert np.allclose(distribution(logits, SamplingParams(1.0, min_p=1.0)), [1, 0, 0, 0])
    assert np.allclose(distribution(logits, SamplingParams(1.0, min_p=0.0)), [0.5, 0.3, 0.15, 0.05])


def test_samples_follow_distribution():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(1.0, seed=3)
    rng = params.rng()
    counts = np.bincount([sample(logits, params, rng) for _ in range(20000)], minlength=3) / 20000
    assert np.allclose(counts, [0.6, 0.3, 0.1], atol=0.015)


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": -0.1},
                                {"min_p": 1.5}])
def test_bad_params(kw):
    with pytest.raises(LeverError):
        SamplingParams(**kw)


def test_rejection_sampling_returns_the_targets_distribution_for_any_draft():
    from lever.model.sampling import draw_without_replacement, rejection_sample

    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    q = np.array([0.05, 0.1, 0.15, 0.2, 0.5], np.float32)  # a draft that is badly off
    for drafted in ("sampled", "by rank"):
        counts = np.zeros(5)
        for _ in range(20000):
            if drafted == "sampled":
                tok, _ = rejection_sample(p, draw_without_replacement(q, 3, rng), q, rng)
            else:
                tok, _ = rejection_sample(p, [4, 3], None, rng)
            counts[tok] += 1
        assert np.abs(counts / counts.sum() - p).max() < 0.012, drafted  # ~4 standard errors


def test_a_draft_equal_to_the_target_is_always_accepted():
    from lever.model.sampling import draw_without_replacement, rejection_sample

    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    assert all(rejection_sample(p, draw_without_replacement(p, 2, rng), p, rng)[1] == 0 for _ in range(200))


def test_the_repeat_penalty_pushes_down_the_last_tokens_once_each():
    from lever.model.sampling import penalize

    logits = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    p = SamplingParams(repeat_penalty=2.0, repeat_last_n=3)
    # tokens 1 and 2 in the last three (0 is older): positive halved, negative doubled; once each
    assert np.allclose(penalize(logits, p, [0, 2, 1, 2]), [2.0, -2.0, 0.25, 3.0])
    assert np.allclose(logits, [2.0, -1.0, 0.5, 3.0])  # a copy
    assert penalize(logits, SamplingParams(), [0, 1]) is logits  # off: nothing done
    assert sample(np.array([1.0, 0.9]), SamplingParams(repeat_penalty=1.5), np.random.default_rng(0), [0]) == 1
    for bad in ({"repeat_penalty": 0.0}, {"repeat_penalty": float("nan")}, {"repeat_last_n": -1}):
        with pytest.raises(LeverError):
            SamplingParams(**bad)
