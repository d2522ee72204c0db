"""lever.model.draws: llama.cpp's random stream and sampler chain, so a seed gives its text.

The stream is std::mt19937's (the C++ standard fixes its 10000th output) feeding libstdc++'s
uniform_real_distribution<double>; the chain keeps what llama.cpp's samplers keep, in its
order; a draw takes one number from the stream and picks as `dist` does. Where llama.cpp's own
llama-completion is built beside this checkout, the text it samples from the shipped stories
model with a seed is the text Lever samples with it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lever.model import draws

ROOT = Path(__file__).resolve().parents[2]
LLAMA_BIN = ROOT.parent / "llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
CASES = 300  # generated rows of logits per property


def rows(seed: int = 0):
    """Rows of logits as models give them: spread, peaked, with ties, of several vocabulary sizes."""
    rng = np.random.default_rng(seed)
    for i in range(CASES):
        n = int(rng.choice([2, 7, 50, 300, 3000]))
        x = rng.normal(0, float(rng.choice([0.3, 2.0, 6.0])), n).astype(np.float32)
        if i % 5 == 0:
            x[rng.integers(0, n, n // 3 + 1)] = x[0]  # exact ties
        yield x, rng


def test_the_stream_is_std_mt19937():
    """[rand.predef]: the 10000th output of a default-seeded (5489) std::mt19937 is 4123659995."""
    assert int(draws.Stream(5489).raw(10000)[-1]) == 4123659995


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 - 2, 2**40 + 7])
def test_a_uniform_is_generate_canonical_of_two_outputs(seed):
    a, b = draws.Stream(seed), draws.Stream(seed)
    for _ in range(200):
        lo, hi = (int(v) for v in b.raw(2))
        u = a.uniform()
        assert 0.0 <= u < 1.0 and u == (lo + hi * 2.0**32) / 2.0**64
    assert a.n_draws == 200


def test_the_chain_keeps_what_each_llama_cpp_sampler_keeps():
    for x, rng in rows():
        top_k = int(rng.choice([0, 1, 5, 40, 10**6]))
        top_p = float(rng.choice([1.0, 0.95, 0.5, 0.01]))
        min_p = float(rng.choice([0.0, 0.05, 0.5]))
        temp = float(rng.choice([0.8, 1.0, 1.7]))
        ids, y, ordered = draws.candidates(x, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temp)
        assert ids.size >= 1 and len(set(ids.tolist())) == ids.size
        assert np.array_equal(y, (x[ids] / np.float32(temp)).astype(np.float32))
        assert ordered == (top_k > 0 or top_p < 1.0)
        if ordered:  # descending, ties to the lower id
            assert all((x[a] > x[b]) or (x[a] == x[b] and a < b) for a, b in zip(ids, ids[1:]))
        else:
            assert np.all(np.diff(ids) > 0)  # token order
        left = np.arange(x.size) if top_k <= 0 else np.lexsort((np.arange(x.size), -x))[:top_k]
        if top_p < 1.0:  # the shortest prefix of the sorted rest whose float mass reaches top_p
            s = left[np.lexsort((left, -x[left]))]
            p = np.exp(x[s] - x[s][0], dtype=np.float32)
            c = np.cumsum(p / np.cumsum(p, dtype=np.float32)[-1], dtype=np.float32)
            reached = c >= np.float32(top_p)
            n_p = int(np.argmax(reached)) + 1 if reached.any() else s.size
            assert ids.size <= n_p and set(ids.tolist()) <= set(s[:n_p].tolist())
        if min_p > 0.0:
            assert np.all(x[ids] >= x[ids].max() + np.float32(np.log(np.float32(min_p))))
        if top_k == 0 and top_p == 1.0 and min_p == 0.0:
            assert ids.size == x.size


def test_no_cut_keeps_every_token_in_token_order():
    x = np.random.default_rng(3).normal(size=97).astype(np.float32)
    ids, y, ordered = draws.candidates(x, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)
    assert np.array_equal(ids, np.arange(97)) and not ordered and np.array_equal(y, x)


def test_a_draw_takes_one_number_and_follows_the_chains_distribution():
    """Each draw advances the stream by one uniform; over many draws the tokens come as often
    as the softmax of the candidates' tempered logits says (a loose bound: 5 sigma)."""
    x = np.array([2.0, 1.0, 0.5, 0.5, -1.0, -3.0, -9.0], np.float32)
    ids, y, _ = draws.candidates(x, top_k=5, top_p=0.99, min_p=0.01, temperature=0.8)
    want = np.exp(y - y.max()) / np.exp(y - y.max()).sum()
    s, n = draws.Stream(7), 20000
    got = np.zeros(x.size)
    for i in range(n):
        got[draws.draw(x, s, top_k=5, top_p=0.99, min_p=0.01, temperature=0.8)] += 1
        assert s.n_draws == i + 1
    sigma = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(got[ids] - n * want) <= 5 * sigma + 1) and got.sum() == got[ids].sum()


def test_one_candidate_still_takes_its_draw():
    s = draws.Stream(1)
    assert draws.draw(np.array([5.0, 0.0, -1.0], np.float32), s, top_k=1, top_p=1.0, min_p=0.0,
                      temperature=0.8) == 0
    assert s.n_draws == 1


def test_the_text_is_llama_cpps_for_the_same_seed(stories):
    """llama-completion's sampled text (its default chain, --temp 0.8) is Lever's, seed for seed."""
    binary = LLAMA_BIN / "llama-completion"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"llama.cpp's llama-completion is not built at {binary} (../shared/tools/build-llama-cpp)")
    from lever.backends.cpu.kv_cache import causal_mask
    from lever.gguf.tokenizer import Tokenizer
    from lever.model.generate import prefill
    from lever.model.transformer import Model

    model, tok = Model(stories), Tokenizer.from_gguf(stories)
    for prompt, seed in [("Once upon a time", 1), ("The little dog", 42), ("Tom and Sue went to the park. They", 99)]:
        cache = model.new_cache(256)
        logits = model.logits(prefill(model, cache, tok.encode(prompt))[None])[0]
        stream, out = draws.Stream(seed), []
        for _ in range(40):
            out.append(draws.draw(logits, stream, top_k=40, top_p=0.95, min_p=0.05, temperature=0.8))
            n = cache.n_rows
            logits = model.logits(model.forward(np.array([out[-1]]), np.array([n], np.int32), causal_mask(n, 1),
                                                cache))[0]
        theirs = subprocess.run([str(binary), "-m", str(stories), "-p", prompt, "-n", "40", "--temp", "0.8",
                                 "--seed", str(seed), "-no-cnv", "-t", "1"], capture_output=True, text=True,
                                timeout=120).stdout
        assert theirs.strip() == (prompt + tok.decode(out)).strip() or \
            theirs.strip().endswith(tok.decode(out).strip()), (prompt, seed)
