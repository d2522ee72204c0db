"""lever.pipelines.engine: what one run takes from its config beyond the graph."""

from __future__ import annotations

from lever.backends.cpu import native
from lever.config import load_config
from lever.pipelines.engine import run_pipeline
from tests.conftest import ROOT


def test_runtime_threads_holds_for_the_run_and_only_for_it():
    seen = []
    cfg = load_config(ROOT / "examples" / "flash-ar.toml", ["runtime.threads=1", "generate.n_predict=3"])
    before = native._threads(None)
    res = run_pipeline(cfg, "def f(x):", observer=lambda layer, tree, x: seen.append(native._threads(None)))
    assert len(res.tokens) == 3 and seen and set(seen) == {1}
    assert native._threads(None) == before
