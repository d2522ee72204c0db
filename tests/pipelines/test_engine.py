"""lever.pipelines.engine: what one run takes from its config beyond the graph."""

from __future__ import annotations

import threading

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


def _beside(block, main_block) -> int:
    """`block` entered on a thread of its own, then `main_block` entered here; the other thread's
    block ends inside this one, then this one ends: how a run in this thread overlaps one in
    another (lever.api's stream thread, a server's request thread) that began before and ends
    first. Events, not sleeps: the order is the same however busy the machine is."""
    entered, go, left = threading.Event(), threading.Event(), threading.Event()

    def other():
        with block:
            entered.set()
            go.wait(60)
        left.set()

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(60)
    with main_block:
        go.set()
        assert left.wait(60)
        seen = native._threads(None)
    t.join(60)
    return seen


def test_a_run_on_another_thread_neither_undoes_this_ones_threads_nor_leaves_its_own():
    base = native.n_threads_default
    # a run that leaves the threads as they are ([runtime] threads = 0) ends during this one's
    assert _beside(native.default_threads(0), native.default_threads(1)) == 1
    assert native.n_threads_default == base
    # two runs that set them, crossed: the later one's count holds while it runs, and after
    # both the process is back where it was (not stuck at the first one's count)
    assert _beside(native.default_threads(3), native.default_threads(1)) == 1
    assert native.n_threads_default == base
