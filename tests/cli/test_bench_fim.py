"""`lever bench fim`: requests cut from the standard library, the same body to each server in
turn, the table and --json; against stand-in servers (a tiny HTTP server answering /health and
/infill as llama-server does), in DRAM and capped; Lever's /infill against its own greedy
decoding on the Qwen pair. Nothing timed."""

from __future__ import annotations

import json
import math
import sys
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.cli.bench.fim import (
    LEVER,
    LLAMA_AR,
    PREFIX_TOKENS,
    SUFFIX_TOKENS,
    FimRequest,
    Row,
    bench_fim,
    greedy_reference,
    own_copies,
    ratio_band,
    row_names,
    rows_for,
    sample_requests,
    stdlib_files,
)
from lever.cli.main import main
from tests.cli.test_bench_cap import needs_cgroup
from tests.sizes import cases

STDLIB = Path(sysconfig.get_paths()["stdlib"])
LLAMA, LLAMA_8 = row_names((3, 8))[1:3]

# A stand-in server: llama-server's --port, /health, /infill's fields; each request it gets
# logged (its name, the body) to one file the servers share, so the order they were asked in
# shows. Its completion is the prefix's last word; `--differ K`: every K-th one differs.
FAKE = r'''
import http.server, json, sys
a = sys.argv[1:]
opt = lambda k, d=None: a[a.index(k) + 1] if k in a else d
name, log, port, differ = opt("--name"), opt("--log"), int(opt("--port")), int(opt("--differ", 0))
seen = [0]

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.send(200 if self.path == "/health" else 404, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(log, "a") as f:
            f.write(json.dumps({"server": name, "path": self.path, "body": body}) + "\n")
        seen[0] += 1
        words = body["input_prefix"].split() or ["x"]
        content = words[-1] + ("!" if differ and seen[0] % differ == 0 else "")
        self.send(200, {"content": content, "tokens": [len(body["input_prefix"]), len(body["input_suffix"])],
                        "tokens_predicted": body["n_predict"], "tokens_evaluated": len(body["input_prefix"]),
                        "timings": {"predicted_n": body["n_predict"]}})

http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def fakes(tmp_path):
    """(rows of stand-ins: Lever's, and llama-server's whose every 2nd completion differs; the log)."""
    script, log = tmp_path / "fake_server.py", tmp_path / "asked.jsonl"
    script.write_text(FAKE)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"\0" * 8192)
    rows = [Row(LEVER, (sys.executable, str(script), "--name", LEVER, "--log", str(log)), (str(model),)),
            Row(LLAMA, (sys.executable, str(script), "--name", LLAMA, "--log", str(log), "--differ", "2"),
                (str(model),))]
    return rows, log


def requests(n: int) -> list[FimRequest]:
    return [FimRequest(f"f{i}.py", 10 + i, f"def f{i}(x):\n    y{i} = ", "\n    return y\n", "x + 1\n")
            for i in range(n)]


def test_requests_are_cut_from_the_standard_library_as_they_stand():
    picked = sample_requests(12, seed=3, root=STDLIB, prefix_lines=32, suffix_lines=12, hole_lines=2, count=len)
    assert picked == sample_requests(12, seed=3, root=STDLIB, prefix_lines=32, suffix_lines=12, hole_lines=2,
                                     count=len)  # a fixed sample: the seed says which
    assert picked != sample_requests(12, seed=4, root=STDLIB, prefix_lines=32, suffix_lines=12, hole_lines=2,
                                     count=len)
    assert len({q.file for q in picked}) == 12
    for q in picked:
        path = STDLIB / q.file
        assert path in stdlib_files(STDLIB) and not any(p.startswith("test") for p in Path(q.file).parts)
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        # the prefix ends at the cursor line's indentation, the hole is that line on, the suffix follows it
        assert q.prefix + q.middle + q.suffix in "".join(lines)
        assert lines[q.line - 1].startswith(q.prefix.rsplit("\n", 1)[-1]) and q.middle.startswith(
            lines[q.line - 1].lstrip())
        assert q.prefix.count("\n") <= 32 and q.suffix.count("\n") <= 12 and q.middle.count("\n") == 2
        assert len(q.prefix) <= PREFIX_TOKENS and len(q.suffix) <= SUFFIX_TOKENS  # `count` was len: characters
        assert q.body(32) == {"input_prefix": q.prefix, "input_suffix": q.suffix, "n_predict": 32,
                              "temperature": 0.0, "return_tokens": True}


@settings(max_examples=cases(50), deadline=None)
@given(st.lists(st.floats(0.01, 100), min_size=1, max_size=12), st.floats(0.05, 20))
def test_the_time_ratio_is_the_geometric_mean_within_its_band(walls, c):
    r = ratio_band([c * w for w in walls], walls)
    assert math.isclose(r["ratio"], c, rel_tol=1e-9) and r["pairs"] == len(walls)
    assert math.isclose(r["band"][0], c, rel_tol=1e-9) and math.isclose(r["band"][1], c, rel_tol=1e-9)
    noisy = ratio_band([w * (1 + i % 3) for i, w in enumerate(walls)], walls)
    assert noisy["min"] <= noisy["band"][0] <= noisy["ratio"] * (1 + 1e-9)
    assert noisy["ratio"] <= noisy["band"][1] * (1 + 1e-9) and noisy["band"][1] <= noisy["max"]


def test_each_request_goes_to_each_server_in_turn_and_the_table_compares_them(fakes, tmp_path):
    rows, log = fakes
    qs, lines = requests(4), []
    doc = bench_fim(qs, rows, n_predict=16, warmup=FimRequest("w.py", 1, "w = ", "\n", "1\n"),
                    greedy=lambda reqs: [[len(q.prefix), len(q.suffix)] for q in reqs], out=lines.append,
                    json_path=tmp_path / "fim.json")
    asked = [json.loads(x) for x in log.read_text().splitlines()]
    assert [a["server"] for a in asked] == [LEVER, LLAMA] * 5  # the warm-up, then the requests alternating
    assert all(a["path"] == "/infill" for a in asked) and asked[0]["body"]["input_prefix"] == "w = "
    for i, q in enumerate(qs):  # the same body to both
        lever, llama = asked[2 + 2 * i], asked[3 + 2 * i]
        assert lever["body"] == llama["body"] == q.body(16)
    rows_ = doc["summary"]["rows"]
    assert rows_[LEVER]["ok"] == rows_[LLAMA]["ok"] == 4 and rows_[LEVER]["tokens"] == 64
    # the stand-in llama-server's 2nd completions differ (its warm-up counted): requests 1 and 3 are equal
    assert (rows_[LLAMA]["same_text"], rows_[LLAMA]["compared"], rows_[LLAMA]["same_prompt"]) == (2, 4, 4)
    assert rows_[LLAMA]["lever_over"]["pairs"] == 4 and doc["summary"]["lever_greedy"] == {"equal": 4, "compared": 4}
    assert [(r["request"], r["server"]) for r in doc["results"]] == [(i, s) for i in range(4) for s in (LEVER, LLAMA)]
    text = "\n".join(lines)
    assert "same text" in text and "2/4" in text and "greedy decoding of the same FIM prompt: 4/4" in text
    assert "peak MiB" not in text and "exited" not in text and "machine load (1-minute average)" in text
    assert all(r["load_1m"] >= 0 for r in doc["results"])
    written = json.loads((tmp_path / "fim.json").read_text())
    assert written["requests"][0]["prefix"] == qs[0].prefix
    assert written["greedy"][0] == [len(qs[0].prefix), len(qs[0].suffix)]
    assert written["died"] == [] and set(written["exits"]) == {LEVER, LLAMA}


def test_a_server_that_dies_fails_its_requests_and_the_others_go_on(fakes, tmp_path):
    rows, log = fakes
    rows = [rows[0], Row(LLAMA_AR, (sys.executable, "-c", "import os, sys, http.server\n"
                                    "a = sys.argv; p = int(a[a.index('--port') + 1])\n"
                                    "class H(http.server.BaseHTTPRequestHandler):\n"
                                    "    def do_GET(self):\n"
                                    "        self.send_response(200); self.end_headers()\n"
                                    "    def do_POST(self):\n"
                                    "        os._exit(3)\n"
                                    "s = http.server.HTTPServer(('127.0.0.1', p), H)\n"
                                    "s.handle_request(); s.handle_request()\n"))]
    lines = []
    doc = bench_fim(requests(2), rows, n_predict=4, out=lines.append)
    r = doc["summary"]["rows"]
    assert r[LEVER]["ok"] == 2 and r[LLAMA_AR]["ok"] == 0 and r[LLAMA_AR]["lever_over"] is None
    assert "2 of 2 requests failed" in "\n".join(lines) and doc["exits"][LLAMA_AR] == 3
    assert doc["died"] == [LLAMA_AR] and "exited before the bench was done: llama-server no draft (exit 3)" in lines


def test_a_server_that_does_not_start_is_a_row_of_failures_saying_why(fakes):
    rows, _ = fakes
    refuses = Row(LEVER, (sys.executable, "-c", "import sys; sys.exit('lever: error: --mem 1G: the plan needs more')"))
    lines = []
    doc = bench_fim(requests(2), [refuses, rows[1]], n_predict=4, warmup=requests(1)[0], out=lines.append)
    r = doc["summary"]["rows"]
    assert r[LEVER]["ok"] == 0 and r[LLAMA]["ok"] == 2 and r[LLAMA]["lever_over"] is None
    assert "the plan needs more" in r[LEVER]["why"] and doc["died"] == [LEVER]


@needs_cgroup
def test_capped_each_server_runs_in_a_cgroup_of_its_own_and_its_peak_is_reported(fakes):
    rows, _ = fakes
    lines = []
    doc = bench_fim(requests(1), rows, n_predict=4, cap_bytes=256 << 20, out=lines.append)
    assert all(0 < p <= 256 << 20 for p in doc["peak_bytes"].values()) and doc["cap_bytes"] == 256 << 20
    assert "peak MiB" in "\n".join(lines) and "cap 256 MiB each" in "\n".join(lines)


def test_the_rows_run_the_same_context_and_threads_and_capped_read_their_own_copies(tmp_path):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"T" * 5000)
    draft.write_bytes(b"D" * 3000)
    t, d = str(target), str(draft)
    assert row_names((3, 8)) == [LEVER, "llama-server k=3", "llama-server k=8", LLAMA_AR]
    files = {LLAMA: (t, d), LLAMA_8: (t, d), LLAMA_AR: (t,)}
    with own_copies([LLAMA, LLAMA_8, LLAMA_AR], files, True) as place:
        rows = {r.name: r for r in rows_for([LEVER, LLAMA, LLAMA_8, LLAMA_AR], target=t, draft=d,
                                            server="/bin/llama-server", ctx=2048, threads=2, cap_bytes=1 << 30,
                                            lever_mem=896 << 20, place=place,
                                            lever_sets=("flash.window_layers=2", "tree_expand.max_nodes=64"))}
        copies = [*rows[LLAMA].evict, *rows[LLAMA_8].evict, *rows[LLAMA_AR].evict]
        assert len(set(copies)) == 5 and not {t, d} & set(copies)  # a copy each, none shared
        assert [Path(p).read_bytes() for p in rows[LLAMA].evict] == [target.read_bytes(), draft.read_bytes()]
    assert not any(Path(p).exists() for p in copies) and target.exists()  # removed after, the originals kept
    lever, spec, ar = rows[LEVER].argv, rows[LLAMA].argv, rows[LLAMA_AR].argv
    assert lever[-12:] == ("--ctx-size", "2048", "--threads", "2", "--mem", "896MiB", "--cache-ram", "0",
                           "--set", "flash.window_layers=2", "--set", "tree_expand.max_nodes=64")
    assert rows[LEVER].evict == (t, d)
    for argv in (spec, ar):
        assert argv[0] == "/bin/llama-server" and "--no-repack" in argv
        assert argv[argv.index("-c") + 1] == "2048" and argv[argv.index("-t") + 1] == "2"
        assert argv[argv.index("-b") + 1] == "512" and argv[-2:] == ("--cache-ram", "0")
    assert "-md" in spec and "-md" not in ar and "--spec-type" not in ar
    for row, k in ((rows[LLAMA], "3"), (rows[LLAMA_8], "8")):  # -md alone would load a draft it never uses
        argv = row.argv
        assert argv[argv.index("--spec-type") + 1] == "draft-simple" and argv[argv.index("--spec-draft-n-max") + 1] == k
    with own_copies([LLAMA], files, False) as place:  # in DRAM: the files as they are
        assert place is None
    dram = rows_for([LLAMA], target=t, draft=d, server="/bin/llama-server", ctx=1024, threads=1)
    argv = dram[0].argv
    assert "--no-repack" not in argv and "--cache-ram" not in argv and argv[argv.index("-md") + 1] == d


@pytest.mark.parametrize("argv,says", [
    (["--rows", "lever,nope"], "--rows: nope is no row"),
    (["--spec-ks", "4", "--rows", "llama-server k=3"], "--rows: llama-server k=3 is no row"),
    (["--spec-ks", "0"], "--spec-ks: "),
    (["--rows", "lever,lever"], "--rows: give each row once"),
    (["--rows", "lever", "--lever-mem", "1G"], "--lever-mem: only under --cap"),
    (["--rows", "lever", "--cap", "1G", "--lever-mem", "2G"], "is not below the cap"),
    (["--rows", "lever", "--cap", "32M"], "below the 64 MiB"),
    (["--rows", "lever", "-m", "/nonexistent.gguf"], "lever pull qwen2.5-coder"),
    (["--rows", "lever,llama-server no draft", "--llama-server", "/nonexistent"], "--llama-server: /nonexistent"),
])
def test_its_arguments_are_refused_in_one_line_before_any_server_starts(argv, says, capsys, tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    models = [] if "-m" in argv else ["-m", str(model), "-md", str(model)]
    assert main(["bench", "fim", *models, *argv]) != 0
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_lever_infill_equals_its_own_greedy_decoding_on_the_qwen_pair(qwen_target, qwen_draft):
    qs = sample_requests(1, seed=1, root=STDLIB, prefix_lines=12, suffix_lines=4, hole_lines=1)
    rows = rows_for([LEVER], target=str(qwen_target), draft=str(qwen_draft), server=None, ctx=1024, threads=2)
    doc = bench_fim(qs, rows, n_predict=12, greedy=greedy_reference(str(qwen_target), ctx=1024, n_predict=12,
                                                                    threads=2), out=lambda _line: None)
    assert doc["summary"]["rows"][LEVER]["ok"] == 1, doc["results"]
    assert doc["summary"]["lever_greedy"] == {"equal": 1, "compared": 1}, (doc["results"], doc["greedy"])
