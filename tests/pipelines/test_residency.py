"""A live memory budget (issue 50): the target's resident layers change while generations run
(lever.pipelines.residency, Engine.set_memory), and each generation's tokens are those of the same
generation left alone: greedy token for token, seeded sampling the same draws. Drops land in the
middle of passes (from PrunedVerify's per-layer observer), grows in the background."""

from __future__ import annotations

import gc
import random
import types

import attrs
import pytest

from lever.config import load_config
from lever.errors import LeverError
from lever.model.grammar import Grammar
from lever.pipelines.compose import Request
from lever.pipelines.engine import Engine
from lever.shipped import shipped
from tests.model.schemas import schemas

PROMPTS = ["def read_config(path):\n", "import os\n\n\ndef walk(root):\n", "class Stack:\n    def push(self, x):\n",
           "for line in open(path):\n", "def merge(a, b):\n    out = []\n"]


@pytest.fixture(scope="module")
def engine():
    # the shipped pair as `lever run` runs it: a quarter of the target's layers resident, trees by gain/cost
    cfg = load_config(shipped("default.toml"), ["generate.n_predict=40", 'pipeline.baseline=""'])
    with Engine.open(cfg) as e:
        yield e


def _alone(engine: Engine, request: Request, cache: dict) -> tuple[int, ...]:
    key = (request.ids, request.generate)
    if key not in cache:
        engine.target.resident.resize(engine.plan.resident)
        assert engine.target.resident.wait_grown(60)
        cache[key] = engine.run(request).tokens
    return cache[key]


def test_layers_dropped_and_read_back_mid_pass_leave_every_generation_as_it_was_alone(engine):
    rng, alone = random.Random(50), {}
    n_layer, residency = engine.plan.spec.n_layer, engine.target.resident
    late0, grown0 = residency.late_reads, residency.grown
    for case in range(10):
        gen = engine.plan.generate if case % 3 else attrs.evolve(engine.plan.generate, temperature=0.8, seed=case)
        request = Request(tuple(engine.encode(rng.choice(PROMPTS))), generate=gen)
        want = _alone(engine, request, alone)
        odds = rng.choice([0.05, 0.2, 0.5])  # of a change after a layer

        def chaos(layer, tree, x):
            if rng.random() < odds:
                residency.resize(rng.sample(range(n_layer), rng.randint(0, n_layer)))

        got = engine.run(attrs.evolve(request, observer=chaos)).tokens
        assert residency.wait_grown(60)
        assert got == want, f"case {case} ({'sampled' if gen.temperature else 'greedy'}, odds {odds})"
    # the cases did what they are about: passes read layers dropped after they were planned, and
    # layers came back while passes ran
    assert residency.late_reads > late0 and residency.grown > grown0


def test_a_generation_under_a_grammar_gives_the_same_text_while_layers_move(engine):
    # the grammar masks at Accept, above the layers: a move must change nothing it sees (generated
    # schemas, greedy and seeded sampling, moves at random layers mid-pass)
    rng, n_layer, residency = random.Random(51), engine.plan.spec.n_layer, engine.target.resident
    late0, alone = residency.late_reads, {}
    for case, schema in enumerate(schemas(51, 6)):
        gen = engine.plan.generate if case % 2 else attrs.evolve(engine.plan.generate, temperature=0.8, seed=case)
        grammar = Grammar.json_schema(engine.tok, schema)
        request = Request(tuple(engine.encode("Reply in JSON.\n" + rng.choice(PROMPTS))), generate=gen, grammar=grammar)
        want = _alone(engine, request, alone)

        def chaos(layer, tree, x):
            if rng.random() < 0.2:
                residency.resize(rng.sample(range(n_layer), rng.randint(0, n_layer)))

        got = engine.run(attrs.evolve(request, observer=chaos)).tokens
        assert residency.wait_grown(60)
        assert got == want, f"case {case} ({'sampled' if gen.temperature else 'greedy'}): {schema}"
        assert grammar.fresh_matcher().consume_tokens([t for t in got if t not in engine.plan.eos_ids])  # it held
    assert residency.late_reads > late0


def test_a_new_budget_plans_within_it_and_holds_what_it_planned(engine):
    rng = random.Random(7)
    floor = engine.plan.memory_plan(engine.n_ctx - 1, engine.process_bytes, resident=frozenset()).total_bytes
    whole = engine.plan.memory_plan(engine.n_ctx - 1, engine.process_bytes,
                                    resident=frozenset(range(engine.plan.spec.n_layer))).total_bytes
    late = max(engine.target.store.layer_bytes)
    for _ in range(12):
        before = engine.target.resident.keys()
        limit = rng.randint(floor + late, whole + 2 * late)
        change = engine.set_memory(limit)
        assert engine.target.resident.wait_grown(60)
        after = engine.target.resident.keys()
        assert change.plan.total_bytes + late <= limit  # a pass reading a dropped layer itself: one layer more
        assert len(after) == change.layers_after and engine.plan.resident == after
        assert after <= before or before <= after  # a shrink reads nothing, a grow drops nothing
        assert engine.target.resident.nbytes == change.plan.resident_layer_bytes  # the plan's figure is what is held
        # the most layers that fit: one more would not
        if len(after) < engine.plan.spec.n_layer:
            more = engine.plan.memory_plan(engine.n_ctx - 1, engine.process_bytes,
                                           resident=after | {min(set(range(engine.plan.spec.n_layer)) - after)})
            assert more.total_bytes + late > limit
        assert engine.run(Request(tuple(engine.encode(PROMPTS[0])))).tokens  # and it runs there


def test_runs_refused_at_the_floor_hold_nothing_after_them(engine):
    # a server at its floor refuses request after request: each failed run's frames (its caches,
    # channels, arrays) must go with it, or the refusals themselves fill the memory that ran out
    request = Request(tuple(engine.encode(PROMPTS[2])))
    with pytest.raises(LeverError):
        engine.set_memory(16 << 20)

    def held() -> int:
        gc.collect()
        return sum(isinstance(o, types.TracebackType | types.FrameType) for o in gc.get_objects())

    try:
        for _ in range(3):
            with pytest.raises(LeverError, match="below this run's floor"):
                engine.run(request)
        before = held()
        for _ in range(12):
            with pytest.raises(LeverError, match="below this run's floor"):
                engine.run(request)
        assert held() <= before + 2  # not a run's worth more per refusal
    finally:
        engine.set_memory(1 << 40)
        assert engine.target.resident.wait_grown(60)


def test_below_the_floor_a_running_generation_stops_with_one_line_naming_the_cap_and_the_floor(engine):
    request = Request(tuple(engine.encode(PROMPTS[1])))
    want = _alone(engine, request, {})
    calls = []

    def squeeze(layer, tree, x):
        calls.append(layer)
        if len(calls) == 40:  # some passes in, mid-pass
            with pytest.raises(LeverError, match="below this run's floor"):
                engine.set_memory(16 << 20)

    with pytest.raises(LeverError) as e:
        engine.run(attrs.evolve(request, observer=squeeze))
    line = str(e.value)
    assert "\n" not in line and "a cap of 16 MiB is below this run's floor of" in line
    assert len(engine.target.resident) == 0  # what it could give back, it gave
    engine.set_memory(1 << 40)  # room again: it runs, and gives what it gave alone
    assert engine.target.resident.wait_grown(60)
    assert engine.run(request).tokens == want
