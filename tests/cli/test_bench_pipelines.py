"""`lever bench pipelines` end to end on a small real model (as its own draft), and its inputs."""

from __future__ import annotations

import argparse
import json

import pytest

from lever.cli.bench.pipelines import bench_pipelines, llama_cpp_flags, llama_cpp_rows
from lever.cli.bench.report import read_prompts
from lever.cli.main import main
from lever.errors import LeverError
from lever.shipped import shipped


def test_the_shipped_prompts_are_code(tmp_path):
    prompts = read_prompts(shipped("prompts", "code.txt"))
    assert len(prompts) >= 4 and all("def " in p or "class " in p for p in prompts)
    f = tmp_path / "p.txt"
    f.write_text("a\n---\n\n---\nb\nc\n")
    assert read_prompts(f) == ["a\n", "b\nc\n"]
    f.write_text("---\n")
    with pytest.raises(LeverError, match="no prompts"):
        read_prompts(f)
    with pytest.raises(LeverError, match="missing.txt"):
        read_prompts(tmp_path / "missing.txt")


def test_bench_runs_every_pipeline_at_every_budget_losslessly(stories, tmp_path):
    cfg = tmp_path / "pair.toml"
    cfg.write_text(f'[model]\ntarget = "{stories}"\ndraft = "{stories}"\n[tree_expand]\nlookahead_nodes = 16\n')
    lines: list[str] = []
    tools = fake_llama_cpp(tmp_path / "bin")
    res = bench_pipelines(str(cfg), ["Once upon a time"], n=16, budgets=(0.0, 1.0), chain_ks=(2,),
                          json_path=tmp_path / "b.json", plot_path=tmp_path / "b.png", out=lines.append,
                          progress=False, llama_cpp=str(tools), n_rounds=2)
    assert res["lossless_mismatches"] == []
    assert set(res["budgets"]) == {"0.0", "1.0"}
    for b, rows in res["budgets"].items():
        assert set(rows) == {"flash-ar", "chain-sd k=2", "edgellm-like", "lever"}
        assert rows["flash-ar"]["speedup"] == 1.0 and rows["flash-ar"]["accepted_per_pass"] == 1.0
        # its own draft: long paths are accepted, and paid for while reads dominate the pass
        assert rows["lever"]["accepted_per_pass"] > (2 if b == "0.0" else 1)
        assert all(r["cpu_ms_per_token"] > 0 for r in rows.values())
        assert rows["lever"]["predicted_cycle_ms"] > 0 and rows["lever"]["measured_cycle_ms"] > 0
        assert rows["flash-ar"]["measured_cycle_ms"] == 0  # no model predicts an autoregressive pass
        assert (rows["lever"]["flash_busy_share"] > 0) == (b != "1.0")  # all resident: nothing read
        assert all(len(r["runs_ms_per_token"]) == 2 for r in rows.values())  # one prompt, two rounds
        # every speculating pipeline's trees are scored by the same acceptance table
        for name in ("chain-sd k=2", "edgellm-like", "lever"):
            assert rows[name]["predicted_tokens_per_cycle"] > 1 and rows[name]["measured_tokens_per_cycle"] >= 1
        s = res["summary"]["per_budget"][b]
        for key in ("flash-ar", "chain-sd", "edgellm-like", "best"):
            lo, hi = s[f"{key}_band"]
            assert lo <= s[key] <= hi
        assert s["best"] <= min(s["flash-ar"], s["chain-sd"], s["edgellm-like"]) * (1 + 1e-9)
    assert {r["round"] for r in res["runs"]} == {0, 1}
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["summary"]["mean"]["flash-ar"] > 0
    # the fake tools decode at 50 and 80 tokens/s: 20 and 12.5 ms a token
    assert report["llama_cpp_ms_per_token"] == {"llama.cpp completion": 20.0, "llama.cpp speculative k=8": 12.5}
    assert any("beside llama.cpp" in line for line in lines)
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert any("lossless: every pipeline" in line for line in lines)
    assert any("band of about 95% over 2 prompt x round pairs" in line for line in lines)


def fake_llama_cpp(d):
    """llama-completion and llama-speculative stand-ins printing the lines the bench reads."""
    d.mkdir()
    (d / "llama-completion").write_text('#!/bin/sh\necho "llama_perf_context_print:        eval time =     300.00 ms /'
                                        '    15 runs   (   20.00 ms per token,    50.00 tokens per second)" >&2\n')
    (d / "llama-speculative").write_text('#!/bin/sh\necho "decoded   16 tokens in    0.200 seconds,'
                                         ' speed:   80.000 t/s" >&2\n')
    for f in d.iterdir():
        f.chmod(0o755)
    return d


def test_llama_cpp_tools_must_be_there(stories, tmp_path):
    cfg = tmp_path / "pair.toml"
    cfg.write_text(f'[model]\ntarget = "{stories}"\ndraft = "{stories}"\n')
    with pytest.raises(LeverError, match="--llama-cpp: .* holds no executable llama-completion"):
        llama_cpp_rows(str(tmp_path), str(cfg), [], ["x"], 4)


def test_llama_cpp_rows_run_under_the_same_grammar(stories, tmp_path):
    cfg = tmp_path / "pair.toml"
    cfg.write_text(f'[model]\ntarget = "{stories}"\ndraft = "{stories}"\n')
    tools = fake_llama_cpp(tmp_path / "bin")
    for f in tools.iterdir():  # each also writes down how it was called
        f.write_text(f.read_text().replace("#!/bin/sh\n", f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n'))
    schema, gbnf, lark = tmp_path / "s.json", tmp_path / "g.gbnf", tmp_path / "g.lark"
    schema.write_text('{"type": "object"}')
    gbnf.write_text('root ::= "yes" | "no"\n')
    lark.write_text('start: "yes" | "no"\n')

    def flags(**given) -> list[str]:
        args = argparse.Namespace(**({"json_schema": None, "grammar": None} | given))
        return llama_cpp_flags(args)
    assert flags() == []
    assert flags(json_schema=schema) == ["-jf", str(schema.resolve())]
    assert flags(grammar=gbnf) == ["--grammar-file", str(gbnf.resolve())]
    with pytest.raises(LeverError, match=f"--llama-cpp: llama.cpp reads GBNF grammars; {lark} is Lark"):
        flags(grammar=lark)
    rows = llama_cpp_rows(str(tools), str(cfg), [], ["x"], 4, flags(json_schema=schema))
    assert set(rows) == {"llama.cpp completion", "llama.cpp speculative k=8"}
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and all(c.endswith(f"-jf {schema.resolve()}") for c in calls)


def test_bad_budgets_are_one_line(capsys, tmp_path):
    assert main(["bench", "pipelines", "-c", str(tmp_path / "x.toml"), "--budgets", "0,half"]) == 1
    assert "--budgets" in capsys.readouterr().err


def test_a_sampled_bench_does_not_claim_or_deny_equal_tokens():
    from lever.cli.bench.pipelines import PAPER, _print_summary

    summary = {"per_budget": {}, "mean": {k: 1.0 for k in PAPER}}
    for sampled, mismatches, needle in ((False, [], "lossless: every pipeline's tokens equal"),
                                        (True, [], "as sampling allows"),
                                        (False, ["lever at budget 0%"], "LOSSLESS CHECK FAILED: greedy tokens")):
        lines = []
        _print_summary(summary, mismatches, lines.append, sampled)
        assert needle in lines[-1]
