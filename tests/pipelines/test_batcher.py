"""The batcher: requests in their own threads, their trees verified in shared passes, each
request's states those it gets alone, bit for bit; joining and leaving mid-flight; reads shared."""

from __future__ import annotations

import threading

import attrs
import numpy as np
import pytest

from lever.backends.cpu.kv_cache import KVCache
from lever.backends.flash import FlashConfig, FlashStore
from lever.config import load_config
from lever.dataflow.messages import TokenTree
from lever.model.transformer import Model
from lever.pipelines.batcher import Batcher, StreamedLayers
from lever.policy.cost import Others
from lever.shipped import shipped
from lever.stages.pruned_verify import PrunedVerify
from tests.stages.test_pruned_verify import kept_path, random_tree


def make(model: Model) -> PrunedVerify:
    return PrunedVerify("verify", model.spec, model.embed, KVCache(model.spec, 96), dict(enumerate(model.layers)))


def script(rng: np.random.Generator, vocab: int, n_passes: int) -> list[TokenTree]:
    """One request's passes: its prompt, then trees keeping a path of the one before."""
    trees = [TokenTree.chain(0, [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 9)))])]
    for pass_id in range(1, n_passes):
        trees.append(random_tree(rng, pass_id, int(rng.integers(1, 7)), vocab,
                                 kept_path(rng, trees[-1]) if pass_id > 1 else None))
    return trees


def run_requests(batcher: Batcher, model: Model, scripts: list[list[TokenTree]], starts: list[float],
                 shares: dict | None = None) -> list:
    """Each script in its own thread, leaving when done; those starting at 0 have joined before
    any thread runs (a pass waits for them), the others join after their delay, mid-flight.
    `shares`: each request's share of its passes' reads, by request."""
    got: list = [None] * len(scripts)
    for start in starts:
        if start == 0:
            batcher.join()

    def request(i: int) -> None:
        if starts[i]:
            threading.Event().wait(starts[i])
            batcher.join()
        try:
            v = make(model)
            got[i] = [batcher.verify(v, t).hidden for t in scripts[i]]
            if shares is not None:
                shares[i] = batcher.take_shares(v)
        finally:
            batcher.leave()

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(scripts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return got


def alone(model: Model, trees: list[TokenTree]) -> list[np.ndarray]:
    v, layers = make(model), dict(enumerate(model.layers))
    return [v.verify(t, layers).hidden for t in trees]


def test_concurrent_requests_each_get_their_own_states_whoever_shares_the_pass(tiny_model):
    model = Model(tiny_model("qwen2", "Q4_K", n_layer=3))
    layers = dict(enumerate(model.layers))
    rng = np.random.default_rng(490)
    shared_any = False
    for case in range(8):
        n = int(rng.integers(2, 6))
        scripts = [script(rng, model.spec.n_vocab, int(rng.integers(2, 7))) for _ in range(n)]
        starts = [float(rng.choice([0.0, 0.0, 0.01, 0.03])) for _ in range(n)]  # some join mid-flight
        batcher = Batcher(lambda: layers, wait_s=0.05)
        got = run_requests(batcher, model, scripts, starts)
        for i, trees in enumerate(scripts):
            for p, (g, want) in enumerate(zip(got[i], alone(model, trees))):
                assert np.array_equal(g, want), f"case {case}, request {i} of {n}, pass {p}"
        assert batcher.trees == sum(len(s) for s in scripts)
        shared_any |= batcher.passes < batcher.trees
    assert shared_any  # requests did share passes (else the test shows nothing about batching)


def test_a_streamed_pass_reads_each_layer_once_for_all_its_trees():
    cfg = load_config(shipped("default.toml"))
    model = Model(cfg.model.target)
    spec = model.spec
    rng = np.random.default_rng(7)
    with FlashStore(cfg.model.target, FlashConfig(mode="direct", dram_budget=0)) as store:
        made: list[StreamedLayers] = []

        def layers() -> StreamedLayers:
            made.append(StreamedLayers(store, model.file, spec, {}))
            return made[-1]

        batcher = Batcher(layers, wait_s=10.0)  # a pass waits until every joined tree is in
        scripts = [script(rng, spec.n_vocab, 3) for _ in range(3)]
        shares: dict[int, list[int]] = {}
        got = run_requests(batcher, model, scripts, [0.0, 0.0, 0.0], shares)
        for i, trees in enumerate(scripts):
            assert all(np.array_equal(g, w) for g, w in zip(got[i], alone(model, trees))), f"request {i}"
        every_layer = sum(store.layer_bytes)
        assert all(m.read_bytes == every_layer for m in made)  # one read of each layer per pass
        assert len(made) == batcher.passes < batcher.trees == 9
        # each request's reads: a third of each of its three passes, every one shared by the three
        assert all(shares[i] == [every_layer // 3] * 3 for i in range(3)), shares
        assert batcher.take_shares(make(model)) == []
        assert store.pool.n_free == store.pool.n_buffers  # every pass gave the window back


PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def", "for i in range(", "# sort a list\n",
           "with open(path) as f:", "x = [", "return self."]


def test_generations_sharing_passes_each_give_their_own_tokens():
    """The shipped pair at budget 0 (every layer streamed): 2-4 generations at once, greedy and
    seeded sampling, some joining after the others started, each through the engine with one
    Batcher; each one's tokens equal its own run alone, and they shared passes."""
    from lever.pipelines.compose import Request
    from lever.pipelines.engine import Engine

    cfg = load_config(shipped("default.toml"), ["flash.dram_budget=0", 'pipeline.baseline=""'])
    rng = np.random.default_rng(4900)
    with Engine.open(cfg) as engine:
        for case in range(3):
            n = int(rng.integers(2, 5))
            prompts = [PROMPTS[i] for i in rng.choice(len(PROMPTS), n, replace=False)]
            gens = [attrs.evolve(engine.plan.generate, n_predict=int(rng.integers(8, 24)),
                                 temperature=float(rng.choice([0.0, 0.8])), seed=int(rng.integers(0, 1000)))
                    for _ in range(n)]
            requests = [Request(engine.encode(p), generate=g) for p, g in zip(prompts, gens)]
            want = [engine.run(r).tokens for r in requests]
            batcher = engine.batcher(wait_s=0.05)
            got: list = [None] * n
            starts = [0.0 if i < 2 else float(rng.choice([0.0, 0.2])) for i in range(n)]

            def run(i: int) -> None:
                threading.Event().wait(starts[i])
                batcher.join()
                try:
                    got[i] = engine.run(attrs.evolve(requests[i], batcher=batcher)).tokens
                finally:
                    batcher.leave()

            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            for i in range(n):
                assert got[i] == want[i], f"case {case}: request {i} of {n} ({gens[i].temperature=}, {prompts[i]!r})"
            assert batcher.passes < batcher.trees, f"case {case}: no pass was shared"


def test_a_tree_is_priced_beside_the_other_requests_trees_of_the_last_passes(tiny_model):
    """What a request's next tree is priced beside (Batcher.others): the other running
    requests' last speculative trees, their nodes and expected tokens; not a prefill, not its
    own, and not a request's that has left. Each hears the whole pass's timing, for its cost
    model to learn what a pass of that many nodes takes."""
    model = Model(tiny_model("qwen2", "Q4_K", n_layer=2))
    layers, vocab = dict(enumerate(model.layers)), model.spec.n_vocab
    rng = np.random.default_rng(4902)
    batcher = Batcher(lambda: layers, wait_s=10.0)  # lockstep: a pass waits for every joined tree
    trees = []
    for _ in range(3):
        first = script(rng, vocab, 2)
        gains = rng.uniform(0, 1, first[1].n_nodes).astype(np.float32)
        trees.append([first[0], attrs.evolve(first[1], gains=gains)])
    seen: list = [None] * 3
    for _ in trees:
        batcher.join()

    def request(i: int) -> None:
        v = make(model)
        batcher.verify(v, trees[i][0])
        after_prefill = batcher.others(v)
        timing = batcher.verify(v, trees[i][1]).timing
        seen[i] = (after_prefill, batcher.others(v), timing)
        batcher.leave()

    threads = [threading.Thread(target=request, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, (after_prefill, after, timing) in enumerate(seen):
        assert timing.n_tokens == sum(t[1].n_nodes for t in trees) and timing.compute_s > 0  # the whole pass's
        assert after_prefill == Others()
        others = [trees[j][1] for j in range(3) if j != i]
        assert after.n_nodes == sum(t.n_nodes for t in others)
        assert after.tokens == pytest.approx(sum(float(t.gains.sum()) for t in others))
    v = make(model)  # passes go on without them: two later, they are forgotten
    for tree in script(rng, vocab, 3):
        batcher.join()
        batcher.verify(v, tree)
        batcher.leave()
    assert batcher.others(v) == Others()
