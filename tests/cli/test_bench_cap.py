"""`lever bench cap`: runs under a memory cgroup on the shipped pair, llama.cpp's lines read,
tokens compared, the summary's ratios, and its inputs."""

from __future__ import annotations

import json
import os
import sys

import pytest

from lever.cli.bench import cgroup
from lever.cli.bench.cap import (
    FLASH_AR,
    LEVER,
    LEVER_LRU,
    LLAMA_COMPLETION,
    CapRun,
    bench_cap,
    check_tokens,
    common_tokens,
    llama_run,
    plot,
    print_summary,
    summarize,
)
from lever.cli.bench.cgroup import Capped, run_capped
from lever.cli.main import main
from lever.gguf.tokenizer import Tokenizer
from lever.shipped import shipped
from tests.deep_target import write_deep_target

MIB = 1 << 20


def cgroup_writable() -> str | None:
    """Why a memory cgroup cannot be made here, or None."""
    try:
        r = run_capped(["true"], 64 * MIB)
    except Exception as e:  # noqa: BLE001 - the reason is the skip's message
        return str(e)
    return None if r.returncode == 0 else f"a capped `true` exited {r.returncode}"


needs_cgroup = pytest.mark.skipif(bool(why := cgroup_writable()), reason=f"no writable memory cgroup: {why}")


@needs_cgroup
def test_a_child_past_its_cap_is_killed_and_its_peak_and_reads_are_counted(tmp_path):
    big = run_capped([sys.executable, "-c", "x = bytearray(400 << 20); x[::4096] = b'1' * len(x[::4096])"], 128 * MIB)
    assert big.killed and big.peak_bytes <= 128 * MIB
    f = tmp_path / "blob"
    with open(f, "wb") as w:
        w.write(b"\1" * (32 * MIB))
        os.fsync(w.fileno())  # a dirty page cannot be evicted
    r = run_capped([sys.executable, "-c", f"open({str(f)!r}, 'rb').read()"], 256 * MIB, evict_paths=[f])
    assert r.returncode == 0 and not r.killed
    # evicted first, so the whole file came from storage, by the kernel's count
    assert r.read_bytes >= 32 * MIB and r.peak_bytes >= 32 * MIB


def fake_llama_cpp(d):
    """llama-completion and llama-speculative stand-ins printing what the bench reads: their
    timing lines (stderr) and text (stdout; llama-speculative echoes the prompt first)."""
    d.mkdir()
    (d / "llama-completion").write_text(
        '#!/bin/sh\nprintf "    return x"\necho "llama_perf_context_print:        eval time =     300.00 ms /'
        '    7 runs   (   20.00 ms per token,    50.00 tokens per second)" >&2\n')
    (d / "llama-speculative").write_text(
        '#!/bin/sh\nprintf "def f(x):\\n    return x"\necho "decoded   8 tokens in    0.100 seconds,'
        ' speed:   80.000 t/s" >&2\nprintf "n_draft   = 4\\nn_predict = 8\\nn_drafted = 8\\nn_accept  = 6\\n" >&2\n')
    for f in d.iterdir():
        f.chmod(0o755)
    return d


@pytest.fixture(scope="module")
def deep_pair(tmp_path_factory):
    """The shipped pair with its target three times as deep (each block, then two that add 0)."""
    d = tmp_path_factory.mktemp("deep")
    target = write_deep_target(shipped("models", "stdlib-target-q4_0.gguf"), d / "deep3.gguf", 3)
    cfg = d / "deep.toml"
    cfg.write_text(f'[model]\ntarget = "{target}"\ndraft = "{shipped("models", "stdlib-draft-q8_0.gguf")}"\n'
                   '[tree_expand]\nmax_depth = 24\n')
    return cfg


def test_the_deep_target_decodes_the_source_tokens(deep_pair):
    from lever.config import load_config
    from lever.pipelines.engine import run_pipeline

    sets = ["generate.n_predict=24", "flash.dram_budget=0", 'pipeline.baseline=""']
    deep = run_pipeline(load_config(deep_pair, sets), "def f(x):\n")
    source = run_pipeline(load_config(shipped("default.toml"), sets), "def f(x):\n")
    assert list(deep.tokens) == list(source.tokens) and len(deep.tokens) == 24
    assert deep.flash.streamed_bytes_per_pass > 2.5 * source.flash.streamed_bytes_per_pass


@needs_cgroup
def test_bench_cap_runs_each_row_in_its_own_capped_process(deep_pair, tmp_path):
    lines: list[str] = []
    tools = fake_llama_cpp(tmp_path / "bin")
    doc = bench_cap(config=str(deep_pair), prompts=["def f(x):\n"], caps=["768M"], n=8, spec_ks=(4,),
                    llama_dir=str(tools), json_path=tmp_path / "c.json", out=lines.append)
    rows = doc["summary"]["per_cap"]["768M"]["rows"]
    assert list(rows) == [FLASH_AR, LEVER, LEVER_LRU, LLAMA_COMPLETION, "llama-spec k=4"]
    assert all(r["ok"] == 1 for r in rows.values()), rows
    lever, ar = rows[LEVER], rows[FLASH_AR]
    for name in (LEVER, LEVER_LRU):  # lossless: Flash-AR's tokens, every one
        assert rows[name]["all_same"] and rows[name]["same_tokens"] == 8
    assert lever["tokens_per_pass"] > 1 and ar["tokens_per_pass"] == 1
    assert 0 < lever["rss_bytes"] <= lever["plan_bytes"] and lever["peak_bytes"] <= 768 * MIB
    assert lever["read_mb_per_token"] > 0  # the files were evicted: loading them was read from storage
    assert rows["llama-spec k=4"]["tokens_per_pass"] == pytest.approx(8 / 2)  # 8 predicted, 6 drafts accepted
    assert rows[LLAMA_COMPLETION]["tps"] == pytest.approx(50.0) and rows["llama-spec k=4"]["tps"] == pytest.approx(80.0)
    over = doc["summary"]["per_cap"]["768M"]["lever_over"]
    assert set(over) == {FLASH_AR, LEVER_LRU, LLAMA_COMPLETION, "llama-spec k=4"}
    assert over[LLAMA_COMPLETION]["pairs"] == 1
    assert json.loads((tmp_path / "c.json").read_text())["runs"][1]["name"] == LEVER
    assert any(line.startswith("cap 768M") for line in lines)


@needs_cgroup
def test_a_cap_no_plan_fits_is_a_row_that_says_so_not_a_crash(tmp_path):
    doc = bench_cap(config=str(shipped("default.toml")), prompts=["def f(x):\n"], caps=["100M"], n=4, spec_ks=(),
                    out=lambda _: None)
    rows = doc["summary"]["per_cap"]["100M"]["rows"]
    for name in (FLASH_AR, LEVER):
        assert rows[name]["ok"] == 0 and rows[name]["status"] in (["error"], ["killed"])
        if rows[name]["status"] == ["error"]:  # refused before loading, naming the limit
            assert "memory" in rows[name]["why"] and "MiB" in rows[name]["why"]


def capped(out="", err="", rc=0) -> Capped:
    return Capped(rc, out, err, peak_bytes=100 * MIB, read_bytes=80_000_000, wall_s=1.0)


def test_llama_speculative_text_follows_the_echoed_prompt_and_its_passes_are_counted():
    err = ("decoded   35 tokens in   17.081 seconds, speed:    2.049 t/s\n"
           "n_predict = 35\nn_drafted = 48\nn_accept  = 31\n")
    r = llama_run(capped(out="\n\ndef f(x):\n    return x + 1", err=err), name="llama-spec k=16", cap_bytes=1,
                  prompt=0, prompt_text="def f(x):\n")
    assert r.status == "ok" and r.text == "    return x + 1" and r.tps == pytest.approx(2.049)
    assert r.tokens_per_pass == pytest.approx(35 / 4) and r.read_mb_per_token == pytest.approx(80 / 35)
    killed = llama_run(Capped(-9, "", "", 1, 0, 1.0), name=LLAMA_COMPLETION, cap_bytes=1, prompt=0, prompt_text="x")
    assert killed.status == "killed"
    silent = llama_run(capped(), name=LLAMA_COMPLETION, cap_bytes=1, prompt=0, prompt_text="x")
    assert silent.status == "error" and "timing" in silent.why


def test_llama_text_is_compared_in_the_reference_tokens():
    tok = Tokenizer.from_gguf(shipped("models", "stdlib-target-q4_0.gguf"))
    ref = tuple(tok.encode("    return x + 1\n", add_bos=False))
    assert common_tokens(ref, tok.decode(list(ref)), tok.decode) == len(ref)
    assert common_tokens(ref, "    return y", tok.decode) < len(ref)
    assert common_tokens(ref, "", tok.decode) == 0
    runs = [CapRun(FLASH_AR, 1, 0, "ok", tokens=ref), CapRun(LEVER, 1, 0, "ok", tokens=ref[:-1] + (ref[-1] + 1,)),
            CapRun(LLAMA_COMPLETION, 1, 0, "ok", text=tok.decode(list(ref)))]
    checked = check_tokens(runs, tok.decode)
    assert checked[0].same_tokens is None  # the reference itself
    assert checked[1].same_tokens == len(ref) - 1 and checked[2].same_tokens == len(ref)


def test_the_summary_pairs_lever_with_each_row_by_prompt(tmp_path):
    runs = [CapRun(FLASH_AR, 1 << 30, p, "ok", tps=1.0, tokens_per_pass=1.0, tokens=(1, 2)) for p in range(2)]
    runs += [CapRun(LEVER, 1 << 30, p, "ok", tps=t, tokens_per_pass=5.0, tokens=(1, 2), plan_bytes=9, rss_bytes=8)
             for p, t in enumerate((4.0, 6.0))]
    runs += [CapRun(LLAMA_COMPLETION, 1 << 30, 0, "killed", why="killed at the cap"),
             CapRun(LLAMA_COMPLETION, 1 << 30, 1, "ok", tps=0.5)]
    s = summarize(check_tokens(runs, lambda ids: ""), ["1G"], [FLASH_AR, LEVER, LLAMA_COMPLETION], 2)
    cap = s["per_cap"]["1G"]
    assert cap["lever_over"][FLASH_AR]["ratio"] == pytest.approx((4 * 6) ** 0.5)
    lo, hi = cap["lever_over"][FLASH_AR]["band"]
    assert lo < (4 * 6) ** 0.5 < hi
    assert cap["lever_over"][LLAMA_COMPLETION] == {"ratio": pytest.approx(12.0), "band": [12.0, 12.0], "pairs": 1}
    assert cap["rows"][LEVER]["all_same"] and cap["rows"][LLAMA_COMPLETION]["status"] == ["killed", "ok"]
    lines: list[str] = []
    print_summary(s, lines.append, target="t.gguf")
    assert any("llama-completion: 1 of 2 runs killed, ok: killed at the cap" in x for x in lines)
    plot(s, tmp_path / "caps.png")
    assert (tmp_path / "caps.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, needle", [
    (["--caps", "2G,lots"], "--caps: 'lots'"),
    (["--caps", "1.5G"], "--caps: '1.5G' is not a whole size"),
    (["--spec-ks", "8,0"], "--spec-ks"),
    (["--mem", "2G"], "--mem: bench cap sets each run's --mem from --caps"),
    (["--llama-cpp", "/nonexistent"], "--llama-cpp: /nonexistent is not a directory"),
    (["--llama-cpp", "/"], "--llama-cpp: / holds no executable llama-completion"),
    (["--rows", "lever,llama"], "--rows: 'llama' is no row; the rows: flash-ar, lever, lever-lru"),
])
def test_bad_arguments_are_one_line(capsys, args, needle):
    assert main(["bench", "cap", "-c", str(shipped("default.toml")), *args]) != 0
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_no_memory_controller_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(cgroup, "V2_ROOT", tmp_path / "none")
    monkeypatch.setattr(cgroup, "V1_ROOT", tmp_path / "none")
    with pytest.raises(Exception, match="no memory cgroup controller"):
        run_capped(["true"], 64 * MIB)
