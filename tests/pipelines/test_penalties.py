"""The logit bias and the penalties are lossless in every pipeline: greedy output under any of
them is lever.model.generate's autoregressive greedy output under the same ones, token for
token; a seeded sampled run is the same text again, and the autoregressive pipeline's is the
plain loop's. Random tiny models, settings drawn by hypothesis."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lever.config import load_config
from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer
from lever.model.generate import generate
from lever.model.transformer import Model
from lever.pipelines.engine import run_pipeline

PROMPT = "the theory in the thin"
N = 24
N_VOCAB = 300  # tests.tiny_gguf's
# autoregressive, and speculative under each tree policy with the target as its own draft (long
# accepted paths: many nodes shaped by their own text) or another model (paths cut short)
PIPELINES = [("flash-ar", None, "same"), ("resident-ar", None, "same"),
             *(("speculative", policy, draft) for policy in ("chain", "kary", "confidence", "gain-cost")
               for draft in ("same", "other"))]

knobs = st.fixed_dictionaries({
    "repeat_penalty": st.floats(0.5, 2.0), "repeat_last_n": st.sampled_from([0, 1, 4, 16, 64]),
    "presence_penalty": st.floats(-2, 2, allow_subnormal=False),
    "frequency_penalty": st.floats(-2, 2, allow_subnormal=False),
    # a few tokens pushed up (then the penalties push them back down), down, or banned
    "logit_bias": st.lists(st.tuples(st.integers(0, N_VOCAB - 1),
                                     st.one_of(st.floats(-6, 6, allow_subnormal=False), st.just(-math.inf))),
                           max_size=8),
    "ignore_eos": st.booleans()})


@pytest.fixture(scope="module")
def models(tiny_model):
    target = tiny_model("qwen2", "Q8_0", n_layer=3)
    return target, tiny_model("qwen2", "Q8_0", n_layer=1, seed=7), Tokenizer.from_gguf(target)


def configured(models, kind: str, policy: str | None, draft: str, **gen):
    target, other, _ = models
    sets = [f'model.target="{target}"', f'pipeline.kind="{kind}"', f"generate.n_predict={N}"]
    if policy is not None:
        sets += [f'model.draft="{target if draft == "same" else other}"', f'tree_expand.policy="{policy}"',
                 "tree_expand.max_nodes=24", "tree_expand.confidence=0.001"]
    cfg = load_config(None, sets)
    return attrs.evolve(cfg, generate=attrs.evolve(cfg.generate, **gen))


def reference(models, cfg) -> list[int]:
    target, _, tok = models
    eos = frozenset(tok.eos_ids)
    return generate(Model(target), tok.encode(PROMPT), N, cfg.generate.params(eos), eos_ids=eos).tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gen=knobs, pipeline=st.sampled_from(PIPELINES))
def test_greedy_under_a_bias_and_penalties_is_the_autoregressive_greedy_output(models, gen, pipeline):
    cfg = configured(models, *pipeline, **gen)
    want = reference(models, cfg)
    assert run_pipeline(cfg, PROMPT).tokens == want
    banned = {t for t, b in cfg.generate.params(frozenset(models[2].eos_ids)).logit_bias.pairs if b == -math.inf}
    assert not banned & set(want)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gen=knobs, pipeline=st.sampled_from(PIPELINES), seed=st.integers(0, 2**31))
def test_seeded_sampling_under_a_bias_and_penalties_is_the_same_text_again(models, gen, pipeline, seed):
    """(Without drafting ahead, whose draws follow the machine's timing.) The autoregressive
    pipelines draw as the plain loop does, one draw a token from the same generator."""
    cfg = configured(models, *pipeline, temperature=0.9, seed=seed, **gen)
    cfg = attrs.evolve(cfg, tree_expand=attrs.evolve(cfg.tree_expand, lookahead_nodes=0))
    a = run_pipeline(cfg, PROMPT).tokens
    assert run_pipeline(cfg, PROMPT).tokens == a
    if pipeline[0] != "speculative":
        assert a == reference(models, cfg)
    banned = {t for t, b in cfg.generate.params(frozenset(models[2].eos_ids)).logit_bias.pairs if b == -math.inf}
    assert not banned & set(a)


def test_a_bias_from_the_config_file_reaches_every_pipeline(models, tmp_path):
    """[generate] logit_bias in TOML (-inf and false: never) pushes the text to the biased token."""
    target, _, _ = models
    sets = [f'model.target="{target}"', f"generate.n_predict={N}", "generate.logit_bias=[[7, 30.0], [9, false]]",
            "generate.frequency_penalty=1.5"]
    cfg = load_config(None, sets)
    assert cfg.generate.logit_bias.pairs == ((7, 30.0), (9, -math.inf))
    toks = run_pipeline(cfg, PROMPT).tokens
    assert toks == reference(models, cfg) and 7 in toks and 9 not in toks
    assert toks.count(7) < N  # the frequency penalty takes it back down past a few


def test_a_bias_outside_the_vocabulary_or_banning_everything_is_one_line(models):
    with pytest.raises(LeverError, match=f"logit_bias: token id {N_VOCAB} is not in the vocabulary of {N_VOCAB}"):
        run_pipeline(configured(models, "flash-ar", None, "same", logit_bias=[[N_VOCAB, 1.0]]), PROMPT)
    every = [[i, False] for i in range(N_VOCAB)]
    with pytest.raises(LeverError, match="logit_bias: bans every token"):
        run_pipeline(configured(models, "flash-ar", None, "same", logit_bias=every), PROMPT)
