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
from tests.sizes import cases

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


@settings(max_examples=cases(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gen=knobs, pipeline=st.sampled_from(PIPELINES))
def test_greedy_under_a_bias_and_penalties_is_the_autoregressive_greedy_output(models, gen, pipeline):
    cfg = configured(models, *pipeline, **gen)
    want = reference(models, cfg)
    assert run_pipeline(cfg, PROMPT).tokens == want
    banned = {t for t, b in cfg.generate.params(frozenset(models[2].eos_ids)).logit_bias.pairs if b == -math.inf}
    assert not banned & set(want)


@settings(max_examples=cases(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gen=knobs, pipeline=st.sampled_from(PIPELINES), seed=st.integers(0, 2**31),
       draws=st.sampled_from(["llama.cpp", "rejection"]))
def test_seeded_sampling_under_a_bias_and_penalties_is_the_same_text_again(models, gen, pipeline, seed, draws):
    """llama.cpp's draws: every pipeline's text is the plain loop's, draw for draw. Rejection
    draws (without drafting ahead, whose draws follow the machine's timing): the same text
    again, and the autoregressive pipelines' is the plain loop's."""
    cfg = configured(models, *pipeline, temperature=0.9, seed=seed, draws=draws, **gen)
    if draws == "rejection":
        cfg = attrs.evolve(cfg, tree_expand=attrs.evolve(cfg.tree_expand, lookahead_nodes=0))
    a = run_pipeline(cfg, PROMPT).tokens
    assert run_pipeline(cfg, PROMPT).tokens == a
    if pipeline[0] != "speculative" or draws == "llama.cpp":
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


def test_the_draft_ranks_by_the_same_bias_through_a_vocabulary_map(tmp_path, monkeypatch):
    """The shipped pair, and its draft with every id moved (tests.gguf.test_vocab_map: the same
    function over another token table): the draft is given the run's bias over its own ids, so it
    never proposes a banned token, and the moved draft proposes exactly what the original does
    (adaptive trees off: the same trees); the output is the target's own either way."""
    import numpy as np

    from lever.shipped import shipped
    from lever.stages.draft import Drafter
    from tests.gguf.test_vocab_map import DRAFT, PROMPT, TARGET, rewrite

    moved = tmp_path / "moved.gguf"
    rewrite(DRAFT, moved, perm=np.random.default_rng(19).permutation(4096))
    proposed: list[np.ndarray] = []
    expand = Drafter.expand

    def recorded(self, req):
        e = expand(self, req)
        proposed.append(np.asarray(e.child_tokens))  # in the target's ids, whatever the draft's table
        return e

    monkeypatch.setattr(Drafter, "expand", recorded)
    tok = Tokenizer.from_gguf(TARGET)
    ban = tok.encode("    ", add_bos=False)[0]  # the indentation the code would take
    seen, texts = [], []
    for draft in (DRAFT, moved):
        proposed.clear()
        cfg = load_config(shipped("default.toml"), [f'model.draft="{draft}"', "generate.n_predict=32",
                                                    'pipeline.baseline=""', "tree_expand.adapt=false",
                                                    f"generate.logit_bias=[[{ban}, false], [12, 1.5]]"])
        texts.append(run_pipeline(cfg, PROMPT).tokens)
        seen.append(np.concatenate([p.ravel() for p in proposed]))
        assert ban not in seen[-1]
    assert np.array_equal(seen[0], seen[1]) and texts[0] == texts[1]
    ref = generate(Model(TARGET), tok.encode(PROMPT), 32, cfg.generate.params(frozenset(tok.eos_ids)),
                   eos_ids=frozenset(tok.eos_ids)).tokens
    assert texts[0] == ref and ban not in ref
