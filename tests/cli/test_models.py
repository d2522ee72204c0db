"""`-m TARGET [-md DRAFT] [--ctx-size N]` without a config (lever.cli.models, lever.pipelines.pairing):
a model named by path runs, lossless, drafting from the free sources when there is no draft
or it cannot propose for the target, and says so in one line."""

from __future__ import annotations

import argparse
import json

import pytest

from lever.cli.models import add_models, bench_config, check_models, config_and_sets
from lever.config import load_config
from lever.errors import LeverError
from lever.pipelines.pairing import pair
from lever.shipped import shipped
from tests.cli.test_main import assert_one_line_error, run_cli

SHIPPED_TARGET = shipped("models", "stdlib-target-q4_0.gguf")
SHIPPED_DRAFT = shipped("models", "stdlib-draft-q8_0.gguf")


def parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_models(p)
    p.add_argument("--set", action="append", default=[])
    return p.parse_args(argv)


def test_a_target_alone_drafts_from_the_free_sources():
    p = pair(str(SHIPPED_TARGET), None)
    cfg = load_config(shipped("model.toml"), list(p.sets))
    assert cfg.model.draft == "" and "model" not in cfg.tree_expand.sources and cfg.tree_expand.sources
    assert cfg.pipeline.kind == "speculative" and "-md" in p.note


def test_a_draft_of_the_same_tokenizer_proposes():
    p = pair(str(SHIPPED_TARGET), str(SHIPPED_DRAFT))
    cfg = load_config(shipped("model.toml"), list(p.sets))
    assert p.note is None and cfg.model.draft.endswith("stdlib-draft-q8_0.gguf") and "model" in cfg.tree_expand.sources


def test_a_draft_of_another_tokenizer_leaves_it_to_the_free_sources(stories):
    p = pair(str(stories), str(SHIPPED_DRAFT))
    cfg = load_config(shipped("model.toml"), list(p.sets))
    assert cfg.model.draft == "" and "model" not in cfg.tree_expand.sources
    assert str(SHIPPED_DRAFT) in p.note and "cannot propose" in p.note and "\n" not in p.note


def test_a_missing_draft_is_an_error_not_a_fallback(tmp_path):
    with pytest.raises(LeverError, match="-md .*no such model"):
        check_models(parsed("-m", str(SHIPPED_TARGET), "-md", str(tmp_path / "typo.gguf")))


def test_flags_order_config_model_then_set():
    said = []
    config, sets = config_and_sets(parsed("-m", str(SHIPPED_TARGET), "--ctx-size", "333"), say=said.append)
    cfg = load_config(config, [*sets, "model.n_ctx=222"])  # a --set after the flags wins
    assert cfg.model.n_ctx == 222 and len(said) == 1
    cfg = load_config(*config_and_sets(parsed("-m", str(SHIPPED_TARGET), "--ctx-size", "333"), say=said.append))
    assert cfg.model.n_ctx == 333
    # with -c, -m and -md replace the config's paths; -md "" turns the draft off
    config, sets = config_and_sets(parsed("-c", str(shipped("default.toml")), "-md", ""))
    cfg = load_config(config, sets)
    assert cfg.model.draft == "" and "model" not in cfg.tree_expand.sources


def test_a_bench_needs_a_config_or_a_model():
    with pytest.raises(LeverError, match="-c CONFIG, or -m"):
        bench_config(parsed())
    assert bench_config(parsed(), required=False) == (None, [])
    config, sets = bench_config(parsed("-m", str(SHIPPED_TARGET), "--set", "generate.n_predict=3"), say=lambda _: None)
    assert config == str(shipped("model.toml")) and sets[-1] == "generate.n_predict=3"


@pytest.mark.parametrize("prompt", ["Once upon a time", "The cat sat", "Lily and Tom went to the park. Lily"])
def test_run_with_a_model_alone_is_lossless(stories, prompt):
    proc = run_cli("run", "-m", str(stories), "-p", prompt, "-n", "24", "--json",
                   "--set", 'pipeline.baseline="flash-ar"')
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["baseline_tokens_equal"] is True and len(res["tokens"]) == 24
    assert proc.stderr.count("lever: no draft model given (-md)") == 1


def test_model_flags_errors_are_one_line(tmp_path):
    assert_one_line_error(run_cli("run", "-m", str(tmp_path / "nope.gguf")), "-m", "no such model", "lever pull")
    assert_one_line_error(run_cli("run", "-md", str(SHIPPED_DRAFT)), "-md", "needs its target")
    assert_one_line_error(run_cli("run", "-m", str(SHIPPED_TARGET), "--ctx-size", "0"), "--ctx-size")
    assert_one_line_error(run_cli("serve", "--alias", ""), "--alias")


def test_a_model_of_the_folder_runs_by_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("LEVER_MODELS", str(tmp_path))
    (tmp_path / "t.gguf").symlink_to(SHIPPED_TARGET)
    args = parsed("-m", "t.gguf", "-md", str(SHIPPED_DRAFT))
    check_models(args)
    assert args.model == str(tmp_path / "t.gguf") and args.model_draft == str(SHIPPED_DRAFT)
    with pytest.raises(LeverError, match="-m t2.gguf: no such model .*lever list"):
        check_models(parsed("-m", "t2.gguf"))
