"""lever.model.bounds: every bound refuses what crashed, exhausted or stalled the engine (issue
44's inputs among them) with the bound and its figure, lets through what apps send, and its
measures agree with brute force on generated cases."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from lever.model import bounds
from lever.model.bounds import BoundError, check_lark, check_schema, longest_chain, regex_weight
from lever.shipped import shipped
from tests.model.test_gbnf import JSON_GBNF


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} "a"' for i in range(n)) + f'\nr{n}: "b"'


@pytest.mark.parametrize("schema, words", [
    (ref_chain(20_000), r"737848 bytes of JSON, over the bound of 262144"),  # issue 44's: 0.7 MB, flat
    (ref_chain(3000), r"a chain of 3002 \$refs, over the bound of 250"),  # crashed the engine from ~2,500
    ({"$defs": {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % 300}"} for i in range(300)}, "$ref": "#/$defs/d0"},
     r"a chain of 301 \$refs"),  # a cycle weighs all its members
    ({"type": "string", "pattern": "^a{1000000}$"}, r"#/pattern: repeats 1000000 times over"),
    ({"type": "string", "pattern": "^(a{1000}){1000}$"}, r"repeats 1000000 times over"),  # 290 MB of automaton
    ({"properties": {"x": {"type": "string", "pattern": "(([a-z]{20}){30}){20}"}}},
     r"#/properties/x/pattern: repeats 12000"),
    ({"patternProperties": {"^k{20000}$": {}}}, r"#/patternProperties: repeats 20000"),
    ({"type": "object", "properties": {f"p{i}": {} for i in range(1001)}}, r"1001 properties, over the bound of 1000"),
    (json.loads('{"items":' * 101 + "{}" + "}" * 101), r"nests 102 levels deep, over the bound of 100"),
])
def test_a_schema_past_a_bound_is_refused_with_the_bound(schema, words):
    with pytest.raises(BoundError, match=words) as e:
        check_schema(schema)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("grammar, words", [
    (lark_chain(20_000), r"357805 bytes, over the bound of 262144"),
    (lark_chain(1900), r"a chain of 1902 rules, each referring to the next, over the bound of 250"),
    ("\n".join(["start: r0", *(f'r{i}: "a"' for i in range(2001))]), r"2002 rules, over the bound of 2000"),
    ('start: "a"{1000000}', r"start: repeats 1000000 times over"),
    ('start: A\nA: B~100\nB: "x"~200', r"A: repeats 20000 times over"),  # a terminal inlines the ones it names
    ('start: A{101}\nA: (B{10}){10}\nB: /x{1,10}/', r"start: repeats 101000 times over"),
    ('start: b{100000}\nb: "x"', r"start: repeats 100000 times over"),  # a rule of one literal is inlined too
    ("start: /((a{30}){30}){30}/", r"repeats 27000 times over"),
    ('start: x\nx: %json {"type": "string", "pattern": "^y{20000}$"}', r"#/pattern: repeats 20000 times over"),
    ("start: " + "(" * 70 + '"a"' + ")" * 70, r"groups nested over 64 deep"),
])
def test_a_lark_grammar_past_a_bound_is_refused_with_the_bound(grammar, words):
    with pytest.raises(BoundError, match=words):
        check_lark(grammar)


def test_what_apps_send_is_within_the_bounds():
    from lever.model.gbnf import to_lark
    from lever.model.tool_calls import required
    from tests.model.test_tool_calls import WEATHER

    schemas = [json.loads(shipped("schemas/function.json").read_text()), {"type": "object"},
               {"$defs": {"node": {"type": "object", "properties": {
                   "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"},
               {"type": "string", "maxLength": 1_000_000, "pattern": "^[a-z]{1,20}@[a-z]{2,8}\\.(com|org)$"},
               {"type": "array", "minItems": 10_000, "items": {"type": "integer"}},
               ref_chain(200), {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}]
    for s in schemas:
        check_schema(s)

    class Tok:
        specials = {"<tool_call>": 7, "</tool_call>": 8}

    for g in [to_lark(JSON_GBNF), required(Tok(), [WEATHER]).text, lark_chain(240), "start: /(a{100}){100}/",
              'start: b{1000}\nb: c{10} | "y"\nc: "x"', 'start: "x = " /[0-9]{1,3}/ ("+" /[0-9]{1,3}/)*']:
        check_lark(g)


def brute_longest(edges: dict[str, list[str]]) -> int:
    """The weight of the heaviest path through the graph of strongly connected components,
    found by reachability: a node's component is the nodes that reach it and that it reaches."""
    nodes = sorted({*edges, *(t for ts in edges.values() for t in ts)})
    reach = {n: {n} for n in nodes}
    for _ in nodes:
        for n in nodes:
            for t in edges.get(n, ()):
                reach[n] |= reach[t]
    comp = {n: frozenset(m for m in nodes if m in reach[n] and n in reach[m]) for n in nodes}
    best: dict[frozenset, int] = {}

    def weight(c: frozenset) -> int:
        if c not in best:
            nxt = {comp[t] for n in c for t in edges.get(n, ()) if comp[t] != c}
            best[c] = len(c) + max((weight(d) for d in nxt), default=0)
        return best[c]

    return max((weight(c) for c in set(comp.values())), default=0)


def test_the_longest_chain_is_brute_forces_on_random_graphs():
    rng = random.Random(3)
    for _ in range(400):
        n = rng.randint(1, 12)
        edges = {str(i): [str(rng.randrange(n)) for _ in range(rng.randint(0, 3))] for i in range(n)
                 if rng.random() < 0.9}
        assert longest_chain(edges) == brute_longest(edges), edges


def test_a_long_chain_is_measured_without_recursion():
    n = 100_000
    assert longest_chain({str(i): [str(i + 1)] for i in range(n)}) == n + 1


def test_a_regex_weighs_its_nested_counts_multiplied():
    rng = random.Random(5)

    def gen(d: int) -> tuple[str, int]:
        """(a regex, its weight) built together."""
        parts, weight = [], 1
        for _ in range(rng.randint(1, 3)):
            k = rng.randrange(5 if d < 3 else 3)
            if k == 0:
                atom, w = rng.choice(["a", "\\d", "[a-z{}]", "\\{", "[^)]", "."]), 1
            elif k == 1:
                atom, w = rng.choice(["b*", "c+", "d?", "(?:e|f)"]), 1
            elif k == 2:
                n = rng.randint(0, 30)
                atom, w = f"x{{{n}}}" if rng.random() < 0.5 else f"x{{1,{n}}}", max(n, 1)
            else:
                inner, w = gen(d + 1)
                n = rng.randint(1, 20)
                atom, w = (f"({inner}){{{n}}}", w * n) if k == 3 else (f"({inner}|z)", w)
            parts.append(atom)
            weight = max(weight, w)
        return "".join(parts), weight

    for _ in range(500):
        rx, w = gen(0)
        assert regex_weight(rx) == w, rx


def test_every_bound_sits_under_where_the_engine_failed():
    """The figures in the module's docstring: a chain of ~2,500 overflowed the engine, so the
    chain bound leaves an order of magnitude; the others stay in their stated ranges."""
    assert bounds.MAX_REFERENCE_CHAIN * 10 <= 2500
    assert bounds.MAX_REPEAT <= 10_000 and bounds.MAX_PROPERTIES <= 1000
    assert all(isinstance(v, int) for v in itertools.chain([bounds.MAX_GRAMMAR_BYTES, bounds.MAX_RULES]))
