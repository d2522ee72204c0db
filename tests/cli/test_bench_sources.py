"""`lever bench sources` end to end on a small real model (as its own draft)."""

from __future__ import annotations

import json
import math

import pytest

from lever.cli.bench.sources import bench_sources


def test_bench_sources_runs_every_source_losslessly_and_compares_run_by_run(stories, tmp_path):
    cfg = tmp_path / "pair.toml"
    cfg.write_text(f'[model]\ntarget = "{stories}"\ndraft = "{stories}"\n')
    lines: list[str] = []
    text = "Once upon a time there was a cat. The cat sat. Once upon a time there was a"
    res = bench_sources(str(cfg), [text, "The dog"], 12, (0.0,), out=lines.append, json_path=tmp_path / "s.json",
                        rounds=3)
    per = res["budgets"]["0.0"]
    assert set(per) == {"flash-ar", "model", "lookup", "model+lookup"}
    assert all(len(x["rounds_ms_per_token"]) == 3 for x in per["model"] + per["model+lookup"])
    band = res["mixed_vs_model"]["0.0"]
    assert band["pairs"] == 6 and band["band"][0] <= band["speedup"] <= band["band"][1]
    assert all(math.isfinite(x) and x > 0 for x in [band["speedup"], *band["band"]])
    assert any("run by run" in line for line in lines)
    assert json.loads((tmp_path / "s.json").read_text())["mixed_vs_model"]["0.0"]["pairs"] == 6


def test_each_free_source_runs_alone_and_the_best_single_source_is_the_fastest_of_all(stories, tmp_path):
    cfg = tmp_path / "pair.toml"
    cfg.write_text(f'[model]\ntarget = "{stories}"\ndraft = "{stories}"\n')
    text = "Once upon a time there was a cat. The cat sat. Once upon a time there was a"
    res = bench_sources(str(cfg), [text], 12, (0.0,), out=lambda _: None,
                        variants=("ngram", "prompt-lookup", "model+lookup"))
    per = res["budgets"]["0.0"]
    assert set(per) == {"flash-ar", "ngram", "prompt-lookup", "model+lookup"}
    assert "mixed_vs_model" not in res  # no model-only run to pair with
    best = min(per["ngram"][0]["ms_per_token"], per["prompt-lookup"][0]["ms_per_token"])
    assert res["mixed_vs_best"]["0.0"] == pytest.approx(best / per["model+lookup"][0]["ms_per_token"])
