"""Trees from the free sources (prompt lookup, the n-gram cache: lever.policy.lookup), alone
with no draft model or beside it in the same tree: greedy output is the target's own, text that
repeats is accepted many tokens a pass, and a sampled run leaves them out (its rejection
sampling needs the draft's distribution), so its draws are the model-only run's."""

from __future__ import annotations

import pytest

from lever.cli.bench.pipelines import read_prompts
from lever.errors import LeverError
from lever.pipelines.engine import run_pipeline
from lever.shipped import shipped
from lever.tree.config import TreeExpandConfig
from tests.pipelines.test_compose import SPEC, config, reference_tokens

FREE = 'tree_expand.sources=["prompt-lookup", "ngram"]'
BOTH = 'tree_expand.sources=["model", "prompt-lookup", "ngram"]'
REPEAT = "def area(w, h):\n    return w * h\n\n\ndef area(w, h):\n    return w * h\n\n\ndef area(w, h):\n"


@pytest.mark.parametrize("budget", ["0", "0.5"])
@pytest.mark.parametrize("sources", [FREE, BOTH], ids=["lookup, no draft model", "model+lookup"])
def test_trees_from_the_free_sources_are_lossless(tiny_model, sources, budget):
    path = tiny_model("qwen2", "Q8_0", n_layer=3)
    draft = tiny_model("qwen2", "Q8_0", n_layer=1, seed=7)
    draft_set = 'model.draft=""' if sources == FREE else f'model.draft="{draft}"'
    res = run_pipeline(config(path, *SPEC, draft_set, sources, "generate.n_predict=40",
                              f"flash.dram_budget={budget}"), "the theory in the thin the theory in the")
    assert res.tokens == reference_tokens(path, "the theory in the thin the theory in the", 40)


def test_code_being_rewritten_is_accepted_several_tokens_a_pass_with_no_draft_model():
    """The first of the shipped rewrite prompts: the answer copies much of the function."""
    prompt = read_prompts(shipped("prompts", "repeat.txt"))[0]
    target = shipped("models", "stdlib-target-q4_0.gguf")
    cfg = config(target, *SPEC, 'model.draft=""', FREE, "generate.n_predict=48")
    res = run_pipeline(cfg, prompt)
    assert res.tokens == reference_tokens(target, prompt, 48)
    assert res.output.tokens_per_pass > 1.5, res.output.tokens_per_pass


def test_the_mixed_tree_on_the_shipped_pair_is_lossless_and_uses_both():
    target, draft = shipped("models", "stdlib-target-q4_0.gguf"), shipped("models", "stdlib-draft-q8_0.gguf")
    cfg = config(target, *SPEC, f'model.draft="{draft}"', BOTH, "generate.n_predict=48")
    res = run_pipeline(cfg, REPEAT)
    assert res.tokens == reference_tokens(target, REPEAT, 48)
    assert res.output.tokens_per_pass > 2


def test_a_sampled_run_leaves_the_free_sources_out(stories):
    """Same seed, same draws: with temperature > 0 the tree is the model's alone."""
    sets = [*SPEC, f'model.draft="{stories}"', "generate.n_predict=30", "generate.temperature=0.8",
            "generate.seed=5", "tree_expand.adapt=false"]
    a = run_pipeline(config(stories, *sets, BOTH), "Once upon a time")
    b = run_pipeline(config(stories, *sets), "Once upon a time")
    assert a.tokens == b.tokens


def test_sources_are_checked_and_a_model_source_needs_a_draft(tiny_model):
    for bad in ((), ("model", "model"), ("nope",)):
        with pytest.raises(LeverError, match="sources"):
            TreeExpandConfig(sources=bad)
    path = tiny_model("qwen2", "Q8_0", n_layer=2)
    with pytest.raises(LeverError, match="draft"):
        run_pipeline(config(path, *SPEC, 'model.draft=""', BOTH), "the")
