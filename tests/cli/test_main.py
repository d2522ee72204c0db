"""The `lever` command end to end: output formats and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from lever.cli.main import main
from tests.conftest import ROOT
from tests.tiny_gguf import write_tiny_model


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lever", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("lever: error: ") and "Traceback" not in err
    for n in needles:
        assert n in err, err


def test_generate_json_fields(stories):
    proc = run_cli("generate", "-m", str(stories), "-p", "Once upon a time", "-n", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"prompt_tokens", "tokens", "text", "prefill_s", "decode_s"} <= out.keys()
    assert out["prompt_tokens"][0] == 1 and len(out["tokens"]) == 12 and out["text"]


def test_generate_streams_same_text_as_json(stories):
    streamed = run_cli("generate", "-m", str(stories), "-p", "Tom had a dog", "-n", "20")
    js = json.loads(run_cli("generate", "-m", str(stories), "-p", "Tom had a dog", "-n", "20", "--json").stdout)
    assert streamed.returncode == 0
    assert streamed.stdout.rstrip("\n") == "Tom had a dog" + js["text"]
    assert "decode:" in streamed.stderr and "tok/s" in streamed.stderr


def test_sampling_with_seed_is_reproducible(stories):
    args = ["generate", "-m", str(stories), "-p", "Once", "-n", "16", "--temp", "0.9", "--top-k", "40",
            "--top-p", "0.9", "--json"]
    a = json.loads(run_cli(*args, "--seed", "7").stdout)["tokens"]
    b = json.loads(run_cli(*args, "--seed", "7").stdout)["tokens"]
    c = json.loads(run_cli(*args, "--seed", "8").stdout)["tokens"]
    assert a == b and a != c


def test_inspect(stories, capsys):
    assert main(["inspect", str(stories)]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "layers:        5" in out and "F32 x48" in out and "292,800" in out


def test_logits_file(stories, tmp_path):
    out = tmp_path / "l.npy"
    assert main(["logits", "-m", str(stories), "--tokens", "1,403,407", "--out", str(out)]) == 0
    logits = np.load(out)
    assert logits.shape == (3, 512) and logits.dtype == np.float32


def test_missing_file():
    assert_one_line_error(run_cli("inspect", "/nonexistent/model.gguf"), "/nonexistent/model.gguf", "no such file")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, this is not a model")
    assert_one_line_error(run_cli("generate", "-m", str(p), "-p", "x"), str(p), "not a GGUF file")


def test_truncated_gguf(stories, tmp_path):
    p = tmp_path / "cut.gguf"
    data = stories.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_cli("generate", "-m", str(p), "-p", "x"), str(p))


def test_unsupported_architecture(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", arch="mamba")
    assert_one_line_error(run_cli("inspect", str(p)), str(p), "unsupported architecture 'mamba'")


def test_unsupported_tensor_type(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", wtype="Q4_1")
    assert_one_line_error(run_cli("inspect", str(p)), str(p), "unsupported tensor type Q4_1")


def test_prompt_over_context(stories):
    proc = run_cli("generate", "-m", str(stories), "-p", "Once upon a time " * 20, "--ctx", "16")
    assert_one_line_error(proc, "over the context of 16")


def test_debug_shows_traceback():
    proc = run_cli("inspect", "/nonexistent/model.gguf", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_bad_token_list(stories):
    assert_one_line_error(run_cli("logits", "-m", str(stories), "--tokens", "1,x", "--out", "/tmp/x.npy"), "--tokens")


def test_ctrl_c_stops_a_run_within_a_second(tiny_model):
    """SIGINT in the middle of streaming: exit 130 within a second, one line, no traceback."""
    import signal
    import time

    path = tiny_model("llama", "F32", n_layer=4)
    proc = subprocess.Popen([sys.executable, "-m", "lever", "run", "-c", str(ROOT / "examples" / "flash-ar.toml"),
                             "-p", "the", "-n", "100000",
                             "--set", f'model.target="{path}"', "--set", "flash.read_latency_ms=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while proc.stdout.read(1) == "" and time.monotonic() < deadline:  # wait until tokens stream
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 1.0
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err


def test_run_json_and_trace(tiny_model, tmp_path):
    path, trace = tiny_model("llama", "F32", n_layer=4), tmp_path / "t.json"
    proc = run_cli("run", "-c", str(ROOT / "examples" / "flash-ar.toml"), "-p", "the", "-n", "6", "--json", "--trace",
                   str(trace), "--set", f'model.target="{path}"')
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for part, keys in (("memory", ("budget_bytes", "peak_rss_bytes", "rss_bound_bytes", "plan")),
                       ("flash", ("read_bytes", "streamed_bytes_per_pass")), ("timing", ("stage_s", "pass_wall_ratio")),
                       ("tree", ("accepted_per_pass", "layer_tokens"))):
        assert set(keys) <= out[part].keys(), part
    assert out["pipeline"] == "flash-ar" and len(out["tokens"]) == 6 and out["text"]
    assert {"verify", "prefetch"} <= out["timing"]["stage_s"].keys() and out["ms_per_token"] > 0
    # CPU time over the decode: positive, and no more than every core busy for the whole of it
    assert 0 < out["timing"]["decode_cpu_s"] <= out["timing"]["decode_s"] * os.cpu_count() + 0.05
    assert out["channels"]["prefetch.layers -> verify.layers"]["sent"] > 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in events} >= {"io", "compute"}


def tracks_nest(events: list[dict]) -> list[str]:
    """Where events on one track overlap without nesting (Perfetto's rule for a track)."""
    bad, by_track = [], {}
    for e in events:
        by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for track, evs in by_track.items():
        open_ends: list[float] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            end = e["ts"] + e["dur"]
            while open_ends and open_ends[-1] <= e["ts"] + 1e-6:
                open_ends.pop()
            if open_ends and end > open_ends[-1] + 1e-6:
                bad.append(f"track {track}: {e['name']} at {e['ts']:.3f} us crosses the end of its enclosing event")
            open_ends.append(end)
    return bad


def test_a_speculative_trace_has_named_tracks_whose_events_nest(tmp_path):
    trace = tmp_path / "t.json"
    proc = run_cli("run", "-n", "24", "--trace", str(trace), "--set", 'pipeline.baseline=""')
    assert proc.returncode == 0, proc.stderr
    all_events = json.loads(trace.read_text())["traceEvents"]
    events = [e for e in all_events if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in all_events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["tid"] for e in events} <= names.keys()  # every track is named
    assert {"draft", "verify", "prefetch", "accept"} <= {n.split(" (")[0] for n in names.values()}
    assert all(e["name"].startswith(names[e["tid"]].split(" (")[0] + ":") for e in events)  # a stage's own tracks
    assert not tracks_nest(events)


def test_the_nesting_check_sees_a_crossing():
    ev = lambda ts, dur: {"pid": 1, "tid": 0, "ts": ts, "dur": dur, "name": "x"}  # noqa: E731
    assert not tracks_nest([ev(0, 10), ev(2, 3), ev(5, 5), ev(10, 1)])
    assert tracks_nest([ev(0, 10), ev(5, 10)])


def test_run_without_a_prompt_uses_the_configs(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\ntarget = "x.gguf"\n')
    assert main(["run", "-c", str(cfg)]) == 1
    assert "no prompt" in capsys.readouterr().err


def test_reads_run_as_far_ahead_as_the_window(tiny_model):
    """The layers channel holds what the staging window holds: with compute slowed, the reads
    fill every buffer of a window of 5 (all five wait while the next tree is drafted), where a
    fixed channel of 2 let no more than 2 wait whatever the window."""
    path = tiny_model("llama", "F32", n_layer=8)
    proc = run_cli("run", "-c", str(ROOT / "examples" / "flash-ar.toml"), "-p", "the", "-n", "4", "--json",
                   "--set", f'model.target="{path}"', "--set", "flash.window_layers=5",
                   "--set", "runtime.emulate_layer_ms_per_token=20")
    assert proc.returncode == 0, proc.stderr
    layers = json.loads(proc.stdout)["channels"]["prefetch.layers -> verify.layers"]
    assert layers["capacity"] == 5 and layers["peak_waiting"] == 5, layers
