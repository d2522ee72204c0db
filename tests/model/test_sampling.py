"""Greedy and sampled token choice: the distribution after temperature, top-k and top-p; the
logit bias and the penalties as llama.cpp applies them."""

import math

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.errors import LeverError
from lever.model.sampling import SamplingParams, distribution, penalize, sample
from tests.sizes import cases


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


# -- llama.cpp's logit bias and penalties (its sampler chain: logit_bias, then penalties)

def llama_cpp_shaped(logits, params, history) -> np.ndarray:
    """llama.cpp's two samplers, written after its llama-sampler.cpp: the logit_bias sampler adds
    each (token, bias) in turn; the penalties sampler keeps a ring of the last penalty_last_n
    accepted tokens with their counts and, for each counted token, divides a positive logit by
    the repeat penalty (else multiplies), then takes count x freq + presence off."""
    out = np.array(logits, np.float32)
    for token, bias in params.logit_bias.pairs:
        out[token] = out[token] + np.float32(bias)
    if params.repeat_last_n == 0 or (params.repeat_penalty == 1.0 and params.frequency_penalty == 0.0
                                     and params.presence_penalty == 0.0):
        return out
    ring, count = [], {}
    for t in history:  # llama_sampler_penalties_accept
        count[t] = count.get(t, 0) + 1
        if len(ring) >= params.repeat_last_n:
            old = ring.pop(0)
            count[old] -= 1
            if count[old] == 0:
                del count[old]
        ring.append(t)
    for t, c in count.items():  # in float, as llama.cpp computes
        x = out[t]
        x = x * np.float32(params.repeat_penalty) if x <= 0 else x / np.float32(params.repeat_penalty)
        out[t] = x - (np.float32(c) * np.float32(params.frequency_penalty) + np.float32(c > 0)
                      * np.float32(params.presence_penalty))
    return out


V_SMALL = 8
biases = st.one_of(st.floats(-30, 30, allow_subnormal=False), st.just(-math.inf), st.just(False))
penalty_params = st.builds(
    SamplingParams,
    repeat_penalty=st.floats(0.25, 4.0), repeat_last_n=st.sampled_from([0, 1, 2, 5, 64]),
    presence_penalty=st.floats(-3, 3, allow_subnormal=False), frequency_penalty=st.floats(-3, 3, allow_subnormal=False),
    logit_bias=st.lists(st.tuples(st.integers(0, V_SMALL - 1), biases), max_size=6))


@settings(max_examples=cases(300), deadline=None)
@given(params=penalty_params, history=st.lists(st.integers(0, V_SMALL - 1), max_size=12),
       logits=st.lists(st.floats(-20, 20, allow_subnormal=False), min_size=V_SMALL, max_size=V_SMALL))
def test_the_logits_are_shaped_as_llama_cpps_sampler_chain_shapes_them(params, history, logits):
    row = np.array(logits, np.float32)
    got = penalize(row, params, history)
    want = llama_cpp_shaped(row, params, history)
    assert np.array_equal(got, want)  # llama.cpp's float arithmetic, to the bit
    assert np.array_equal(row, np.array(logits, np.float32))  # a copy
    assert sample(row, params, np.random.default_rng(0), history) == int(np.argmax(got))
    if np.isfinite(got).any():  # sampled: a banned token has no probability
        p = distribution(row, attrs.evolve(params, temperature=0.7), history)
        assert np.all(p[np.isneginf(got)] == 0.0) and math.isclose(p.sum(), 1.0)


def test_presence_and_frequency_count_the_last_tokens_after_the_repeat_penalty():
    logits = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    p = SamplingParams(repeat_penalty=2.0, repeat_last_n=4, presence_penalty=0.5, frequency_penalty=0.25)
    # token 2 twice, token 1 once among the last four (0 is older): halved or doubled, then c/4 + 1/2 off
    assert np.allclose(penalize(logits, p, [0, 2, 1, 2, 2]), [2.0, -2.0 - 0.75, 0.25 - 1.25, 3.0])
    only = SamplingParams(frequency_penalty=1.0)  # the repeat penalty at 1: the others alone apply
    assert np.allclose(penalize(logits, only, [3, 3]), [2.0, -1.0, 0.5, 1.0])
    assert penalize(logits, SamplingParams(presence_penalty=1.0, repeat_last_n=0), [3]) is logits  # looks at none


def test_the_logit_bias_comes_first_and_adds_up():
    logits = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    p = SamplingParams(repeat_penalty=2.0, logit_bias=[(0, 1.0), (0, 1.0), (2, False), (1, -2)])
    # biased then penalized: token 0 is 4.0 when the repeat penalty sees it, so 2.0
    assert np.allclose(penalize(logits, p, [0]), [2.0, -3.0, -np.inf, 3.0])
    assert sample(logits, SamplingParams(logit_bias={"3": -math.inf}), np.random.default_rng(0)) == 0
    assert penalize(logits, SamplingParams(logit_bias=()), [0]) is logits


@pytest.mark.parametrize("value", [
    [[0, 1.0], [1]], [[-1, 1.0]], [[True, 1.0]], [[1.5, 1.0]], [[0, math.nan]], [[0, math.inf]], [[0, True]],
    [[0, 2e6]], [[0, "1"]], {"a": 1.0}, {"-3": 1.0}, "0", 3, [[0, 1.0]] * 4097, [[2**31, 1.0]],
])
def test_a_bad_logit_bias_is_one_line_naming_it(value):
    with pytest.raises(LeverError, match="^logit_bias: ") as e:
        SamplingParams(logit_bias=value)
    assert "\n" not in str(e.value)


def test_a_logit_bias_is_checked_against_the_vocabulary():
    from lever.model.sampling import LogitBias

    LogitBias([[3, 1.0]]).check(4)
    with pytest.raises(LeverError, match="logit_bias: token id 4 is not in the vocabulary of 4"):
        LogitBias([[4, 1.0]]).check(4)
    with pytest.raises(LeverError, match="logit_bias: bans every token"):
        LogitBias([[0, False], [1, False]]).banning({2, 3}).check(4)
    assert LogitBias({"0": 1.0, 1: False}).pairs == ((0, 1.0), (1, -math.inf))
    assert LogitBias([[1, 1.0], [1, -0.5]]).apply(np.zeros(3, np.float32)).tolist() == [0.0, 0.5, 0.0]


@pytest.mark.parametrize("kw", [{"presence_penalty": 1e4}, {"frequency_penalty": -1e4},
                                {"presence_penalty": math.nan}, {"frequency_penalty": math.inf}])
def test_bad_penalties(kw):
    with pytest.raises(LeverError, match=next(iter(kw)).replace("_", "-")):
        SamplingParams(**kw)
