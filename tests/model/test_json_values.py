"""JSON-like values an app hands over as Python objects (lever.nesting.check_json at the doors of
json_schema and tools): over generated trees with one hostile thing put in at a random place (a
key that is not a string, a value that is not JSON, a container inside itself, nesting past the
bound, a shared list that doubles past the bound of values), each is refused with one line
naming the argument and the place, quickly, and never with another exception; the same trees
without it pass, and schemas built of them still compile. No model: the shipped tokenizer."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from lever.errors import LeverError
from lever.gguf.tokenizer import Tokenizer
from lever.model import bounds
from lever.model.grammar import Grammar, GrammarError, compile_args
from lever.model.grammar_cache import GrammarCache
from lever.model.tool_calls import plan
from lever.nesting import INT_RANGE, MAX_NODES, JsonValueError, check_json, depth
from lever.shipped import shipped
from tests.load import within
from tests.sizes import cases

# no explain phase: it traces every line it replays, ten times the time a check takes
SETTINGS = settings(max_examples=cases(200), derandomize=True, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SECONDS = 1.0  # a refusal's time bound (a check of the most values it visits takes 0.2 s)
KEYS = st.one_of(st.from_regex(r"[a-z_$][a-z0-9_]{0,5}", fullmatch=True), st.text(max_size=4))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(*INT_RANGE),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
# a JSON value as Python holds it (a tuple is a list to json.dumps)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                                       st.dictionaries(KEYS, inner, max_size=4)), max_leaves=24)
BAD_KEYS = [1, -7, 2.5, None, True, b"k", (1, 2), frozenset({1})]
BAD_VALUES = [{1, 2}, b"bytes", bytearray(b"x"), object(), 1j, float("nan"), float("inf"), -math.inf, 1 << 64,
              -(1 << 63) - 1, 10 ** 5000, len, range(3), Ellipsis]
KINDS = ("key", "value", "cycle", "depth", "nodes")


def step(k) -> str:
    """How a path shows one key (the rule messages follow: lever.nesting): .name, [index], or
    the key's repr in brackets (cut at 40 characters)."""
    if isinstance(k, int):
        return f"[{k}]"
    plain = k != "" and k[0].isascii() and (k[0].isalpha() or k[0] in "_$") and \
        all(c.isascii() and (c.isalnum() or c in "_$-") for c in k)
    text = repr(k)
    return f".{k}" if plain else f"[{text if len(text) <= 40 else text[:37] + '...'}]"


def containers(value) -> list[tuple[object, tuple]]:
    """Every container in `value` with the keys leading to it."""
    out, stack = [], [(value, ())]
    while stack:
        v, keys = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            out.append((v, keys))
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend((x, (*keys, k)) for k, x in items)
    return out


def value_words(v) -> str:
    if isinstance(v, float):
        return "is not a finite number"
    if isinstance(v, int):
        return "is past 64 bits"
    return f"a value of type {type(v).__name__} is not JSON"


@dataclasses.dataclass(frozen=True)
class Case:
    """A JSON tree and one hostile thing to put in it, drawn small (what a failure shows) and
    built fresh by `build`: the tree is a dict at the root, as a schema is."""

    base: dict
    kind: str  # one of KINDS
    target: int  # which list or dict of the tree takes it (in `containers` order)
    pick: int  # which bad key or value, which ancestor, lists or dicts
    slot: str  # its key, in a dict
    max_depth: int

    def build(self) -> tuple[dict, tuple, str]:
        """(the tree with the hostile thing in it, the keys to where it is, the message's words)."""
        tree = copy.deepcopy(self.base)
        places = containers(tree)
        target, keys = [(c, k) for c, k in places if not isinstance(c, tuple)][self.target]
        where = (*keys, len(target) if isinstance(target, list) else self.slot)
        if self.kind == "key":
            put, where, words = {BAD_KEYS[self.pick % len(BAD_KEYS)]: 0}, where, "JSON keys are strings"
        elif self.kind == "value":
            put = BAD_VALUES[self.pick % len(BAD_VALUES)]
            words = value_words(put)
        elif self.kind == "cycle":
            up = keys[: self.pick % (len(keys) + 1)]  # an ancestor, or the target itself
            put = next(c for c, k in places if k == up)
            words = f"the same {type(put).__name__} as json_schema{''.join(map(step, up))} (a cycle)"
        elif self.kind == "depth":
            put, words = chain(self.max_depth, self.pick % 2 == 0), f"nests deeper than {self.max_depth} levels"
        else:
            put, words = doubling(18), f"over the bound of {MAX_NODES} values"
        if isinstance(target, list):
            target.append(put)
        else:
            target[self.slot] = put
        return tree, where, words


@st.composite
def hostile(draw, max_depth: int) -> Case:
    base = {"type": "object", "properties": draw(st.dictionaries(KEYS, VALUES, max_size=4))}
    targets = [(c, k) for c, k in containers(base) if not isinstance(c, tuple)]  # a tuple takes nothing put in
    i = draw(st.integers(0, len(targets) - 1))
    taken = targets[i][0] if isinstance(targets[i][0], dict) else {}
    return Case(base, draw(st.sampled_from(KINDS)), i, draw(st.integers(0, 1000)),
                draw(KEYS.filter(lambda k: k not in taken)), max_depth)


def chain(n: int, lists: bool):
    """n levels of lists (or dicts) one inside the next."""
    v: object = 0
    for _ in range(n):
        v = [v] if lists else {"a": v}
    return v


def doubling(n: int) -> list:
    """A list of two references to the same list, n times over: n levels, 2**n paths."""
    v: object = 0
    for _ in range(n):
        v = [v, v]
    return v


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(shipped("models/stdlib-target-q4_0.gguf"))


@SETTINGS
@given(VALUES)
def test_json_values_pass_and_serialize(value):
    check_json(value, "v", max_depth=bounds.MAX_SCHEMA_DEPTH)
    json.dumps(value)


@SETTINGS
@given(hostile(max_depth=bounds.MAX_SCHEMA_DEPTH))
def test_a_hostile_value_is_one_line_naming_the_argument_and_the_place(case):
    tree, keys, words = case.build()
    kind = case.kind
    t0 = time.monotonic()
    with pytest.raises(JsonValueError) as e:
        check_json(tree, "json_schema", max_depth=bounds.MAX_SCHEMA_DEPTH)
    assert within(time.monotonic() - t0, SECONDS)
    message = str(e.value)
    assert "\n" not in message and words in message and e.value.where == "json_schema"
    at = "" if kind == "nodes" else "".join(map(step, keys))
    if kind == "depth":  # where the chain passes the bound, below the place it was put (a long path cut)
        assert e.value.at.startswith("".join(map(step, keys[:6]))) and "more)" in e.value.at
    else:
        assert e.value.at == at and message.startswith(f"json_schema{at}: "), (message, at)


@settings(SETTINGS, max_examples=cases(100))
@given(hostile(max_depth=bounds.MAX_SCHEMA_DEPTH))
def test_a_hostile_schema_is_a_grammar_error_before_any_compile(tok, case):
    """Through the doors a call goes through: the grammar cache (the LLM's), compile_args,
    Grammar.json_schema; GrammarError naming json_schema, never TypeError, RecursionError or
    a hang."""
    tree = case.build()[0]
    cache = GrammarCache(tok)
    for door in (lambda: cache.get(json_schema=tree), lambda: compile_args(tok, json_schema=tree),
                 lambda: Grammar.json_schema(tok, tree)):
        t0 = time.monotonic()
        with pytest.raises(GrammarError) as e:
            door()
        assert within(time.monotonic() - t0, SECONDS)
        assert e.value.field == "json_schema" and str(e.value).startswith("json_schema") and "\n" not in str(e.value)
    assert cache.compiled == 0  # refused before the compiler's child was asked


@settings(SETTINGS, max_examples=cases(100))
@given(hostile(max_depth=64), st.booleans())
def test_hostile_tool_parameters_or_entries_are_one_line_naming_the_tool(tok, case, in_parameters):
    """In a function's parameters or beside them (the template writes the whole entry): one line
    naming the tool and the place (the tool itself for the bound of values, which it counts)."""
    tree = case.build()[0]
    f = {"name": "f", "parameters": tree} if in_parameters else {"name": "f", "x-meta": tree}
    for choice in ("auto", "required"):
        t0 = time.monotonic()
        with pytest.raises(LeverError) as e:
            plan(tok, [{"type": "function", "function": {"name": "ok"}}, {"type": "function", "function": f}], choice)
        assert within(time.monotonic() - t0, SECONDS)
        where = "tools[1].function.parameters" if in_parameters else "tools[1].function.x-meta"
        if case.kind == "nodes" and not in_parameters:
            where = "tools[1]: over the bound"
        assert str(e.value).startswith(where) and "\n" not in str(e.value), str(e.value)


SCHEMAS = st.recursive(
    st.sampled_from([{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": 0}, {"type": "boolean"},
                     {"type": "null"}, {"enum": ["a", 1, None]}]),
    lambda inner: st.one_of(
        st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, min_size=1, max_size=4).map(
            lambda p: {"type": "object", "properties": p, "required": sorted(p)[:1]}),
        inner.map(lambda s: {"type": "array", "items": s, "maxItems": 3})),
    max_leaves=8)


@settings(SETTINGS, max_examples=cases(40))
@given(SCHEMAS, st.booleans())
def test_json_schemas_still_compile_shared_parts_too(tok, schema, share):
    if share:  # one sub-schema object in two places: not a cycle
        schema = {"type": "object", "properties": {"a": schema, "b": schema}, "required": ["a", "b"]}
    assert depth(schema) <= bounds.MAX_SCHEMA_DEPTH
    g = compile_args(tok, json_schema=schema)
    assert g is not None and g.source == "json_schema"


@pytest.mark.parametrize("grammar", [5, 2.5, b'start: "a"', ["start: x"], {"start": "x"}, object(), True])
def test_a_grammar_that_is_not_text_is_one_line(tok, grammar):
    for door in (lambda: compile_args(tok, grammar=grammar), lambda: GrammarCache(tok).get(grammar=grammar)):
        with pytest.raises(GrammarError, match=rf"^grammar: must be Lark or GBNF text \(a str\) or a compiled "
                                               rf"Grammar, got {type(grammar).__name__}$"):
            door()


def test_the_bound_of_values_meets_the_bound_of_bytes():
    """Two bytes of JSON a value at least ("0,", "[]"): the densest value within
    MAX_GRAMMAR_BYTES of text is within MAX_NODES values, one more is past both bounds; the
    value bound refuses nothing the byte bound would let compile."""
    n = (bounds.MAX_GRAMMAR_BYTES - 1) // 2  # zeros in a list: 2n + 1 bytes, n + 1 values
    for zeros, fits in ((n, True), (n + 1, False)):
        value = [0] * zeros
        assert (len(json.dumps(value, separators=(",", ":"))) <= bounds.MAX_GRAMMAR_BYTES) is fits
        if fits:
            check_json(value, "json_schema", max_depth=1)
        else:
            with pytest.raises(JsonValueError, match=f"^json_schema: over the bound of {MAX_NODES} values"):
                check_json(value, "json_schema", max_depth=1)
