"""lever.cli.bench: `lever bench flash` measures Flash-AR whatever pipeline the config composes;
`lever bench model` sets each test beside llama-bench's."""

from __future__ import annotations

import pytest

from lever.cli.bench.flash import bench_flash
from tests.conftest import ROOT

DEFAULT = str(ROOT / "examples" / "default.toml")  # composes Lever (speculative), not Flash-AR


def test_bench_flash_runs_flash_ar_on_any_config():
    rows = bench_flash(DEFAULT, "def f(x):", 16, budgets=(0.0, 1.0), out=lambda *a: None)
    assert [r["pipeline"] for r in rows] == ["flash-ar", "flash-ar"] and "baseline" not in rows[0]
    # One token per pass, every streamed byte from the device each pass (Lever would read a
    # pass per several tokens: about a third of this on the shipped pair).
    zero = rows[0]
    assert 0.9 < zero["flash_mb_per_token"] * 1e6 / zero["flash"]["streamed_bytes_per_pass"] < 1.2
    assert rows[1]["flash"]["streamed_bytes_per_pass"] == 0



FAKE_LLAMA_BENCH = """#!{python}
import json, sys
a = sys.argv
pp = [int(n) for n in a[a.index("-p") + 1].split(",")]
n_gen = int(a[a.index("-n") + 1])
rows = [dict(n_prompt=n, n_gen=0, avg_ts=100.0 * n) for n in pp] + [dict(n_prompt=0, n_gen=n_gen, avg_ts=50.0)]
print(json.dumps(rows))
"""


def test_bench_model_runs_both_models_of_a_config_beside_llama_bench(tmp_path):
    """`lever bench model -c`: the target and the draft, tg and pp at 1, 8 and 32 tokens, each
    beside llama-bench's figure for the same test (a stand-in that prints llama-bench's JSON),
    the ratios of the medians, and --json with where it was measured."""
    import json
    import subprocess
    import sys

    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "lever", "bench", "model", "-c", DEFAULT, "--llama-bench",
                           str(fake), "--rounds", "1", "--n-gen", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [m["model"].rsplit("/", 1)[-1] for m in report["models"]] == ["stdlib-target-q4_0.gguf",
                                                                           "stdlib-draft-q8_0.gguf"]
    assert report["isa"] and report["cpu"] and report["cores"] >= 1
    for m in report["models"]:
        assert set(m["tests"]) == {"tg8", "pp1", "pp8", "pp32"}
        for name, t in m["tests"].items():
            assert t["llama_tps"] == (50.0 if name == "tg8" else 100.0 * int(name[2:]))
            assert t["lever_tps"] > 0 and t["ratio"] == pytest.approx(t["lever_tps"] / t["llama_tps"])  # one round
    assert proc.stdout.count("ratio") == 2 and "pp32" in proc.stdout


def test_bench_model_needs_one_of_model_or_config():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "lever", "bench", "model"], capture_output=True, text=True)
    assert proc.returncode == 1 and "give -m MODEL.gguf or -c CONFIG" in proc.stderr
