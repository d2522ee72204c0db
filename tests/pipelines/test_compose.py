"""Pipelines end to end: lossless against `generate`, errors and cancellation through the graph."""

from __future__ import annotations

import io
import os
import re
import threading
import time

import anyio
import psutil
import pytest

from lever.cli.run import print_summary
from lever.config import load_config
from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer
from lever.model.generate import GREEDY, generate
from lever.model.sampling import SamplingParams
from lever.model.transformer import Model
from lever.pipelines.compose import Request, compose
from lever.pipelines.engine import run_pipeline
from lever.pipelines.plan import RunPlan
from lever.pipelines.target import FlashTarget
from tests.load import within

PROMPT = "the theory in the thin"


def config(path, *sets):
    return load_config(None, [f'model.target="{path}"', "generate.n_predict=12", *sets])


def reference_tokens(path, prompt=PROMPT, n=12, params=GREEDY):
    model, tok = Model(path), Tokenizer.from_gguf(path)
    return generate(model, tok.encode(prompt), n, params, eos_ids=frozenset(tok.eos_ids)).tokens


@pytest.mark.parametrize("mode", ["direct", "mmap"])
@pytest.mark.parametrize("budget", ["0", "0.5", "1.0"])
@pytest.mark.parametrize("arch,wtype", [("llama", "F32"), ("qwen2", "Q4_K"), ("qwen3", "Q8_0")])
def test_flash_ar_equals_autoregressive(tiny_model, arch, wtype, mode, budget):
    path = tiny_model(arch, wtype, n_layer=4)
    res = run_pipeline(config(path, f'flash.mode="{mode}"', f"flash.dram_budget={budget}"), PROMPT)
    assert res.tokens == reference_tokens(path)
    assert res.timing.n_passes == len(res.tokens)


def test_stories_flash_ar_reproduces_generate(stories):
    cfg = config(stories, "generate.n_predict=40")
    assert run_pipeline(cfg, "Once upon a time").tokens == reference_tokens(stories, "Once upon a time", 40)


def test_resident_pipeline_reads_nothing_per_pass(tiny_model):
    path = tiny_model("llama", "F32", n_layer=4)
    res = run_pipeline(config(path, 'pipeline.kind="resident-ar"'), PROMPT)
    assert (res.tokens == reference_tokens(path) and res.flash.streamed_bytes_per_pass == 0
            and res.memory.window_bytes == 0)


def test_sampling_with_seed_equals_generate(tiny_model):
    path = tiny_model("qwen2", "Q4_0", n_layer=2)
    sets = ["generate.temperature=0.8", "generate.top_k=50", "generate.seed=11"]
    res = run_pipeline(config(path, *sets), PROMPT)
    assert res.tokens == reference_tokens(path, params=SamplingParams(0.8, 50, 0.95, 11, min_p=0.05))  # the chain's


def test_read_error_reaches_caller_naming_stage(tiny_model, monkeypatch):
    from lever.backends.flash import FlashStore

    path = tiny_model("llama", "F32", n_layer=4)
    real_read, calls = FlashStore.read, []

    def failing_read(self, r, buf):
        calls.append(r)
        if len(calls) > 6:
            raise LeverError(f"{self.path}: layer {r.layer}, offset {r.file_offset}: read failed (EIO)")
        return real_read(self, r, buf)

    monkeypatch.setattr(FlashStore, "read", failing_read)
    with pytest.raises(LeverError, match="read failed") as info:
        run_pipeline(config(path), PROMPT)
    assert any("in stage 'prefetch'" in n for n in info.value.__notes__)


def test_cancellation_stops_within_a_second_and_releases_everything(tiny_model):
    """A cancelled run (what Ctrl-C does) ends promptly, leaving no threads and no open files."""
    path = tiny_model("llama", "F32", n_layer=4)
    proc = psutil.Process(os.getpid())
    threads0, files0 = threading.active_count(), {f.path for f in proc.open_files()}
    cfg = config(path, "generate.n_predict=100000", "flash.read_latency_ms=5")
    plan = RunPlan.resolve(cfg)
    target = FlashTarget.open(path, plan.flash, resident=plan.resident)
    h = compose(target, None, plan, Request(plan.tok.encode(PROMPT)))

    async def main():
        with anyio.move_on_after(0.5):
            await h.pipeline.run()

    t0 = time.perf_counter()
    anyio.run(main)
    stopped_s = time.perf_counter() - t0 - 0.5
    target.close()
    assert within(stopped_s, 1.0), stopped_s
    assert 0 < len(h.output.tokens) < 100000
    deadline = time.monotonic() + 30  # worker threads end just after the run (later on a loaded machine)
    while threading.active_count() > threads0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= threads0, [t.name for t in threading.enumerate()]
    assert {f.path for f in proc.open_files()} <= files0


SPEC = ['pipeline.kind="speculative"']


@pytest.mark.parametrize("policy", ["chain", "kary", "confidence", "gain-cost"])
@pytest.mark.parametrize("draft_seed", [0, 7], ids=["draft=target", "other-draft"])
def test_speculative_greedy_equals_autoregressive(tiny_model, policy, draft_seed):
    """Whatever the draft proposes, greedy output is the target's own greedy output."""
    path = tiny_model("qwen2", "Q8_0", n_layer=3)
    draft = tiny_model("qwen2", "Q8_0", n_layer=1, seed=draft_seed) if draft_seed else path
    # a random tiny model's probabilities are flat: a low confidence bar lets its trees grow
    res = run_pipeline(config(path, *SPEC, f'model.draft="{draft}"', f'tree_expand.policy="{policy}"',
                              "generate.n_predict=40", "tree_expand.max_nodes=24", "tree_expand.confidence=0.001"),
                       PROMPT)
    assert res.tokens == reference_tokens(path, n=40)
    if draft_seed == 0 and policy != "gain-cost":  # the draft is the target: the greedy path is accepted
        assert res.output.tokens_per_pass > 1.5  # (gain-cost may rightly keep trees tiny for a flat random model)


@pytest.mark.parametrize("policy", ["chain", "gain-cost"])
def test_drafting_ahead_is_lossless_and_hits(stories, policy):
    """With the flash slowed so that passes leave time idle, the draft works ahead during
    verification; output is unchanged and some cycles start from rows drafted ahead."""
    cfg = config(stories, *SPEC, f'model.draft="{stories}"', "generate.n_predict=60", f'tree_expand.policy="{policy}"',
                 "tree_expand.lookahead_nodes=24", "flash.bandwidth_cap_bytes_per_s=2e6")
    res = run_pipeline(cfg, "Once upon a time")
    assert res.tokens == reference_tokens(stories, "Once upon a time", 60)
    assert res.trees.lookahead_hit_share > 0.2 and res.timing.draft_hidden_share > 0.1


def test_a_draft_equal_to_the_target_has_every_chain_accepted(stories):
    """The draft's cache follows the accepted text exactly, the leaves it never ran included:
    a draft that is the target proposes the target's own tokens, so every chain is taken whole."""
    cfg = config(stories, *SPEC, f'model.draft="{stories}"', 'tree_expand.policy="chain"', "tree_expand.chain_length=4",
                 "generate.n_predict=41")
    res = run_pipeline(cfg, "Once upon a time")
    assert res.tokens == reference_tokens(stories, "Once upon a time", 41)
    assert [c.tokens for c in res.trees.cycles] == [5] * 8


@pytest.mark.parametrize("draft_seed", [0, 7], ids=["draft=target", "other-draft"])
def test_fallback_shapes_are_lossless_in_any_order(tiny_model, monkeypatch, draft_seed):
    """Gain-cost's fallback grows chains and the root alone between its trees (the draft
    catching up after the root alone): greedy output is the target's own, and a seeded sampled
    run is the same text twice."""
    from lever.policy import fallback

    script = [fallback.TREE, fallback.ROOT, fallback.ROOT, fallback.Shape("chain", 3), fallback.ROOT,
              fallback.TREE, fallback.Shape("chain", 1), fallback.ROOT, fallback.TREE]
    seen: list = []  # each run's Fallback, kept alive so that no id is reused
    calls: dict[int, int] = {}  # per run: each follows the script from its start

    def choose(self, cost, first_child):
        if id(self) not in calls:
            seen.append(self)
        n = calls[id(self)] = calls.get(id(self), -1) + 1
        return script[n % len(script)]

    monkeypatch.setattr(fallback.Fallback, "choose", choose)
    path = tiny_model("qwen2", "Q8_0", n_layer=3)
    draft = tiny_model("qwen2", "Q8_0", n_layer=1, seed=draft_seed) if draft_seed else path
    sets = [*SPEC, f'model.draft="{draft}"', "generate.n_predict=40", "tree_expand.max_nodes=24",
            "tree_expand.lookahead_nodes=8"]
    res = run_pipeline(config(path, *sets), PROMPT)
    assert res.tokens == reference_tokens(path, n=40)
    assert {"none", "chain k=3", "gain-cost"} <= set(res.trees.shapes)
    # (without drafting ahead, whose draws follow the machine's timing)
    sampled = [*sets, "generate.temperature=0.8", "generate.seed=5", "tree_expand.lookahead_nodes=0"]
    assert run_pipeline(config(path, *sampled), PROMPT).tokens == run_pipeline(config(path, *sampled), PROMPT).tokens


def test_speculative_sampling_runs_on_real_models(stories):
    """Sampled, with the draft equal to the target: its drawn tokens are the target's own
    distribution, so rejection sampling accepts them and passes emit several tokens; the
    same seed gives the same text."""
    cfg = config(stories, *SPEC, f'model.draft="{stories}"', "generate.n_predict=40", "generate.temperature=0.8",
                 "generate.seed=3")
    a, b = run_pipeline(cfg, "Once upon a time"), run_pipeline(cfg, "Once upon a time")
    assert a.tokens == b.tokens and len(a.tokens) == 40
    assert a.output.tokens_per_pass > 2


def test_speculative_on_stories_accepts_many_per_pass(stories):
    """Its own draft, and a slow flash so that reads dominate: gain-cost grows deep trees."""
    cfg = config(stories, *SPEC, f'model.draft="{stories}"', "generate.n_predict=60",
                 "flash.bandwidth_cap_bytes_per_s=5e6")
    res = run_pipeline(cfg, "Once upon a time")
    assert res.tokens == reference_tokens(stories, "Once upon a time", 60)
    assert res.output.tokens_per_pass > 4 and res.timing.n_passes < 20


def test_every_cycle_is_predicted_and_measured(stories):
    """The cost model's cycle beside the measured one, per cycle, and the online corrections
    learnt from the run (a capped flash the profile does not know about: reads slower than priced)."""
    cfg = config(stories, *SPEC, f'model.draft="{stories}"', "generate.n_predict=40", "flash.dram_budget=0.0")
    res = run_pipeline(cfg, "Once upon a time")
    tr = res.trees
    assert len(tr.cycles) == res.timing.n_passes - 1  # every decoding pass, not the prefill
    assert sum(c.tokens for c in tr.cycles) == len(res.tokens) - 1
    assert all(c.predicted_s > 0 and c.measured_s > 0 and c.predicted_tokens >= 1 for c in tr.cycles)
    assert tr.cycles[0].scales.read == 1.0 and tr.cycles[-1].scales != tr.cycles[0].scales
    assert 0 < res.timing.flash_busy_share <= 1
    d = res.as_json()
    assert d["tree"]["measured_cycle_s"] == pytest.approx(tr.measured_cycle_s) and d["tree"]["predicted_tokens"] >= 1
    buf = io.StringIO()
    print_summary(res, buf)
    assert re.search(r"model +cycle predicted \d+ ms, measured \d+ ms; tokens/cycle predicted [\d.]+, measured [\d.]+; "
                     r"flash busy \d+% of the run", buf.getvalue())


@pytest.mark.parametrize("n_ctx", [17, 23, 31, 40])
def test_speculative_stops_at_context_like_generate(tiny_model, n_ctx):
    """Whatever the trees' depths at the end, the text stops where it fills the context, as
    autoregressive decoding's does: the same tokens, prompt and reply n_ctx in all."""
    path = tiny_model("llama", "F32", n_layer=2)
    cfg = config(path, *SPEC, f'model.draft="{path}"', f"model.n_ctx={n_ctx}", "generate.n_predict=100")
    res = run_pipeline(cfg, PROMPT)
    model, tok = Model(path), Tokenizer.from_gguf(path)
    want = generate(model, tok.encode(PROMPT), 100, n_ctx=n_ctx, eos_ids=frozenset(tok.eos_ids))
    assert res.tokens == want.tokens and res.stop_reason == want.stop_reason == "context"
    assert len(tok.encode(PROMPT)) + len(res.tokens) == n_ctx


def test_speculative_needs_a_draft(tiny_model):
    with pytest.raises(LeverError, match=r"\[model\] draft"):
        run_pipeline(config(tiny_model("llama", "F32"), *SPEC), PROMPT)


def test_a_baseline_runs_after_on_the_same_prompt(stories):
    """[pipeline] baseline: the summary's speedup is measured in the same run, tokens checked."""
    cfg = config(stories, *SPEC, f'model.draft="{stories}"', 'pipeline.baseline="flash-ar"', "generate.n_predict=24")
    res = run_pipeline(cfg, "Once upon a time")
    assert res.baseline is not None and res.baseline.pipeline == "flash-ar"
    assert res.baseline_tokens_equal and res.speedup > 0
    assert res.as_json()["baseline"]["tokens"] == res.tokens


def test_an_unknown_baseline_is_one_line():
    with pytest.raises(LeverError, match=r"\[pipeline\] baseline: unknown pipeline 'fast'"):
        load_config(None, ['pipeline.baseline="fast"'])


PRUNE = ["predictor.enabled=true", "predictor.layer=1", "predictor.max_prune_share=1.0", "predictor.cost_aware=false"]


@pytest.mark.parametrize("policy", ["chain", "kary", "confidence", "gain-cost"])
def test_pruning_is_lossless_on_every_policy(tiny_model, policy):
    """A predictor that prunes nearly everything it may can shorten what is accepted, never
    change a token."""
    path = tiny_model("qwen2", "Q8_0", n_layer=3)
    draft = tiny_model("qwen2", "Q8_0", n_layer=1, seed=7)
    # gains at the draft's word: a random draft's calibrated acceptance is nearly nil, and gain-cost
    # would rightly grow trees too small to prune
    res = run_pipeline(config(path, *SPEC, *PRUNE, "predictor.threshold=0.99", f'model.draft="{draft}"',
                              f'tree_expand.policy="{policy}"', "generate.n_predict=40", "tree_expand.max_nodes=24",
                              "tree_expand.confidence=0.001", 'tree_expand.acceptance="identity"'), PROMPT)
    assert res.tokens == reference_tokens(path, n=40)
    if policy != "chain":  # a chain is all backbone: nothing to prune
        assert res.verify.pruned_share > 0.2


@pytest.mark.parametrize("threshold", [0.05, 0.5])
def test_pruning_on_the_shipped_pair_cuts_late_layers_and_keeps_tokens(threshold):
    """The trained pair: real trees, real scores. Pruning cuts the verification compute after
    the predictor's layer and the tokens stay the target's own."""
    target, draft = (f"examples/models/stdlib-{n}.gguf" for n in ("target-q4_0", "draft-q8_0"))
    prompt = "def read_config(path):\n"
    base = [*SPEC, f'model.draft="{draft}"', "generate.n_predict=48", "tree_expand.max_nodes=32"]
    plain = run_pipeline(config(target, *base), prompt)
    pruned = run_pipeline(config(target, *base, *PRUNE, "predictor.layer=2", f"predictor.threshold={threshold}"),
                          prompt)
    assert pruned.tokens == plain.tokens == reference_tokens(target, prompt, 48)
    assert pruned.verify.pruned_share > 0
    assert pruned.verify.prune_layer == 2
    late_share = [sum(r.verify.layer_tokens[3:]) / sum(r.verify.layer_tokens[:3]) for r in (plain, pruned)]
    assert late_share[0] == pytest.approx(1.0)  # every node runs every layer
    assert late_share[1] < 1.0


def test_an_emulated_slow_verification_unit_slows_every_layer(tiny_model):
    """[runtime] emulate_layer_ms_per_token: each layer of a pass lasts at least n x that."""
    path = tiny_model("qwen2", "Q8_0", n_layer=3)
    res = run_pipeline(config(path, "runtime.emulate_layer_ms_per_token=20.0", "generate.n_predict=6"), PROMPT)
    assert res.ms_per_token >= 3 * 20.0
    assert res.tokens == reference_tokens(path, n=6)
