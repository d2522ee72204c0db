"""llama.cpp's draws make seeded sampling lossless token for token: with [generate] draws =
"llama.cpp" (the default) every pipeline's sampled text is lever.model.generate's autoregressive
sampled text from the same seed, whatever trees the policy grows, whether they adapt to the
machine's timing, whether the draft drafts ahead or the free sources propose, under a grammar
too. The shipped pair, seeds and sampler settings drawn by hypothesis."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lever.config import load_config
from lever.gguf.tokenizer import Tokenizer
from lever.model.generate import generate
from lever.model.transformer import Model
from lever.pipelines.engine import run_pipeline
from lever.shipped import shipped
from tests.sizes import cases

N = 32
PROMPTS = ["def parse_args(argv):", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def push(self, x):"]
PIPELINES = [  # (overrides) each a different way trees are grown
    ['tree_expand.policy="gain-cost"'],  # Lever's, adapting to the clock
    ['tree_expand.policy="chain"', "tree_expand.max_depth=6"],
    ['tree_expand.policy="kary"'],
    ['tree_expand.sources=["model", "prompt-lookup", "ngram"]'],
    ['model.draft=""', 'tree_expand.sources=["prompt-lookup", "ngram"]'],  # no draft model
    ["tree_expand.lookahead_nodes=0"],  # no drafting ahead
]
sampler = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.3, 0.8, 1.0, 1.5]), "top_k": st.sampled_from([0, 1, 5, 40]),
    "top_p": st.sampled_from([1.0, 0.95, 0.5]), "min_p": st.sampled_from([0.0, 0.05, 0.2]),
    "seed": st.integers(0, 2**32 - 1)})


def config(overrides, knobs):
    sets = [f"generate.n_predict={N}", 'pipeline.baseline=""', *overrides,
            *(f"generate.{k}={v}" for k, v in knobs.items())]
    return load_config(shipped("default.toml"), sets)


@settings(max_examples=cases(30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(knobs=sampler, overrides=st.sampled_from(PIPELINES), prompt=st.sampled_from(PROMPTS))
def test_every_pipeline_samples_what_autoregressive_decoding_samples(knobs, overrides, prompt):
    cfg = config(overrides, knobs)
    res = run_pipeline(cfg, prompt)
    tok = Tokenizer.from_gguf(cfg.model.target)
    eos = frozenset(tok.eos_ids)
    want = generate(Model(cfg.model.target), tok.encode(prompt), N, cfg.generate.params(eos), eos_ids=eos)
    assert res.tokens == want.tokens


def test_the_seed_decides_the_text():
    """Two seeds, two texts (the draws come from the seed, not from anything fixed)."""
    a = run_pipeline(config(PIPELINES[0], {"temperature": 1.0, "seed": 1}), PROMPTS[0]).tokens
    b = run_pipeline(config(PIPELINES[0], {"temperature": 1.0, "seed": 2}), PROMPTS[0]).tokens
    assert a != b
