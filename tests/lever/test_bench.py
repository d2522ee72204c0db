"""lever.bench: `lever bench flash` measures Flash-AR whatever pipeline the config composes."""

from __future__ import annotations

from lever.bench import bench_flash
from tests.conftest import ROOT

DEFAULT = str(ROOT / "examples" / "default.toml")  # composes Lever (speculative), not Flash-AR


def test_bench_flash_runs_flash_ar_on_any_config():
    rows = bench_flash(DEFAULT, "def f(x):", 16, budgets=(0.0, 1.0), out=lambda *a: None)
    assert [r["pipeline"] for r in rows] == ["flash-ar", "flash-ar"] and "baseline" not in rows[0]
    # One token per pass, every streamed byte from the device each pass (Lever would read a
    # pass per several tokens: about a third of this on the shipped pair).
    zero = rows[0]
    assert 0.9 < zero["flash_mb_per_token"] * 1e6 / zero["streamed_bytes_per_pass"] < 1.2
    assert rows[1]["streamed_bytes_per_pass"] == 0

