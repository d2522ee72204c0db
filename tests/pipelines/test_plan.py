"""lever.pipelines.plan: a run resolved once, before anything loads, and read by everything after."""

from __future__ import annotations

import inspect
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.config import PIPELINE_KINDS, load_config
from lever.errors import LeverError
from lever.pipelines.compose import Request, compose
from lever.pipelines.engine import Engine, run_pipeline
from lever.pipelines.plan import RunPlan
from lever.tree.config import MIN_SHARED_NODES, TreeExpandConfig
from tests.conftest import ROOT
from tests.sizes import cases

DEFAULT = ROOT / "examples" / "default.toml"
SOURCES = {"model": '["model"]', "free": '["prompt-lookup", "ngram"]', "both": '["model", "prompt-lookup"]'}


def plan_of(*sets: str, kind: str | None = None) -> RunPlan:
    return RunPlan.resolve(load_config(DEFAULT, ["generate.n_predict=6", 'pipeline.baseline=""', *sets]), kind)


@pytest.mark.parametrize("kind", PIPELINE_KINDS)
@pytest.mark.parametrize("policy", ["none", "chain", "gain-cost"])
@pytest.mark.parametrize("sources", SOURCES)
def test_the_draft_model_runs_exactly_when_the_plan_says(kind, policy, sources):
    """plan.drafts is the one answer: the draft loads, and compose joins a Draft stage, iff it
    holds; it holds for a kind that speculates, a policy that grows trees, "model" among the sources."""
    plan = plan_of(f'tree_expand.policy="{policy}"', f"tree_expand.sources={SOURCES[sources]}", kind=kind)
    want = PIPELINE_KINDS[kind].speculates and policy != "none" and sources != "free"
    assert plan.drafts == want
    assert (plan.draft_file is not None) == want and (plan.vocab is None)  # the shipped pair shares one table
    assert plan.tree.policy == (policy if PIPELINE_KINDS[kind].speculates else "none")
    with Engine.open(load_config(DEFAULT, [f'tree_expand.policy="{policy}"',
                                           f"tree_expand.sources={SOURCES[sources]}"]), kind) as engine:
        assert (engine.draft is not None) == want
        h = compose(engine.target, engine.draft, engine.plan, Request(engine.encode("def f(x):")))
        assert (h.draft is not None) == want and ("draft" in h.pipeline.to_mermaid()) == want


def test_an_all_resident_kind_keeps_every_layer_whatever_the_budget():
    plan = plan_of("flash.dram_budget=0", kind="resident-ar")
    assert plan.flash.dram_budget == 1.0 and plan.resident == frozenset(range(plan.spec.n_layer))
    assert plan_of("flash.dram_budget=0", kind="flash-ar").resident == frozenset()
    assert plan_of("flash.dram_budget=0", kind="flash-ar").cost is None  # no trees to price
    assert plan_of(kind="speculative").cost is not None


def test_a_speculative_plan_without_a_draft_names_the_key():
    with pytest.raises(LeverError, match=r"\[model\] draft"):
        plan_of('model.draft=""', kind="speculative")
    assert not plan_of('model.draft=""', 'tree_expand.sources=["prompt-lookup"]', kind="speculative").drafts


def test_compose_takes_the_models_a_plan_and_a_request():
    assert list(inspect.signature(compose).parameters) == ["target", "draft", "plan", "request"]


@pytest.mark.parametrize("kind", ["speculative", "flash-ar"])
def test_the_layers_kept_in_dram_are_planned_once_a_run(kind, monkeypatch):
    """One plan_residency call: the memory plan, the flash store and the cost model read its set."""
    calls = []
    for module in list(sys.modules.values()):
        real = getattr(module, "plan_residency", None)
        if callable(real) and getattr(module, "__name__", "").startswith("lever"):
            def counted(*a, _real=real, **k):
                calls.append(a)
                return _real(*a, **k)
            monkeypatch.setattr(module, "plan_residency", counted)
    cfg = load_config(DEFAULT, ["generate.n_predict=6", 'pipeline.baseline=""', f'pipeline.kind="{kind}"',
                                "flash.dram_budget=0.5"])
    res = run_pipeline(cfg, "def f(x):")
    assert len(calls) == 1 and len(res.tokens) == 6
    assert res.memory.plan.resident_layer_bytes == res.memory.resident_layer_bytes > 0


@settings(max_examples=cases(60), deadline=None)
@given(max_nodes=st.integers(1, 256), max_depth=st.integers(1, 128), lookahead=st.integers(0, 64),
       parallel=st.integers(1, 16))
def test_trees_sharing_a_pass_share_its_node_cap(max_nodes, max_depth, lookahead, parallel):
    """[pipeline] parallel N: each tree's caps are its share of max_nodes (at least
    MIN_SHARED_NODES, never above max_nodes), depth and drafting ahead within them; alone, the
    config's own. The plan's tree is that share, and the memory plan is made with it."""
    cfg = TreeExpandConfig(max_nodes=max_nodes, max_depth=max_depth, lookahead_nodes=lookahead)
    one = cfg.per_tree(parallel)
    if parallel == 1:
        assert one == cfg
        return
    assert min(max_nodes, MIN_SHARED_NODES) <= one.max_nodes <= max_nodes
    assert one.max_nodes * parallel <= max(max_nodes, MIN_SHARED_NODES * parallel) + parallel
    assert one.max_depth <= min(max_depth, one.max_nodes - 1) or one.max_nodes == 1
    assert one.lookahead_nodes <= min(lookahead, one.max_nodes)


def test_the_plan_holds_each_tree_at_its_share():
    alone = plan_of("tree_expand.max_nodes=128", "tree_expand.max_depth=64")
    eight = plan_of("tree_expand.max_nodes=128", "tree_expand.max_depth=64", "pipeline.parallel=8")
    assert alone.tree.max_nodes == 128 and eight.tree.max_nodes == 16 and eight.tree.max_depth == 15
    per = eight.memory_plan(8).activation_bytes / 8
    assert per < alone.memory_plan(8).activation_bytes
