"""lever.model.grammar_cache: a grammar is compiled once and found again by its text, the cache
holds at most its bytes (the least recently used leave), a burst of one schema from several
threads compiles once, and refusals name the argument."""

from __future__ import annotations

import threading

import pytest

from lever.gguf.tokenizer import Tokenizer
from lever.model.grammar import GrammarError, Source
from lever.model.grammar_cache import GrammarCache, plan_bytes
from lever.shipped import shipped


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(shipped("models/stdlib-target-q4_0.gguf"))


def schema(k: int, n_props: int = 300) -> dict:
    """A distinct schema of ~1.5 MB compiled (enums of 40 values over n_props properties)."""
    return {"type": "object", "properties": {f"k{k}_{i}": {"enum": [f"v{j}_{k}" for j in range(40)]}
                                             for i in range(n_props)}}


def test_a_grammar_is_compiled_once_and_found_by_its_text(tok):
    cache = GrammarCache(tok)
    try:
        a = cache.get(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
        b = cache.get(json_schema={"properties": {"a": {"type": "integer"}}, "type": "object"})  # the same, reordered
        assert a is b and cache.compiled == 1 and cache.hits == 1 and a.nbytes > 0
        lark = cache.get('start: "x"')
        assert cache.get('start: "x"') is lark and cache.get(Source('start: "x"', "tool_choice")) is not lark
    finally:
        cache.close()


def test_the_cache_holds_at_most_its_bytes_the_oldest_leaving(tok):
    cache = GrammarCache(tok, capacity_bytes=8 << 20)
    try:
        kept = [cache.get(json_schema=schema(k)) for k in range(12)]
        assert all(g.nbytes > 512 << 10 for g in kept)
        assert cache.nbytes <= 8 << 20 and len(cache._kept) < 12
        cache.get(json_schema=schema(11))  # the newest is there
        assert cache.compiled == 12
        cache.get(json_schema=schema(0))  # the oldest left: compiled again
        assert cache.compiled == 13
    finally:
        cache.close()


def test_a_burst_of_one_schema_compiles_once(tok):
    cache = GrammarCache(tok)
    got = []
    try:
        threads = [threading.Thread(target=lambda: got.append(cache.get(json_schema=schema(99)))) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert cache.compiled == 1 and len({id(g) for g in got}) == 1
    finally:
        cache.close()


@pytest.mark.parametrize("kw, field", [
    ({"grammar": 'start: "a"{100000}'}, "grammar"), ({"json_schema": {"pattern": "a{100000}"}}, "json_schema"),
    ({"grammar": Source('start: "a"{100000}', "tool_choice")}, "tool_choice"),
    ({"json_schema": {"items": {"items": {}}} | {"$defs": {"x": [[[[]]] * 2]}}}, None),
])
def test_refusals_name_the_argument(tok, kw, field):
    cache = GrammarCache(tok)
    try:
        if field is None:  # within the bounds: compiled
            assert cache.get(**kw) is not None
            return
        with pytest.raises(GrammarError, match=f"^{field}: .*over the bound") as e:
            cache.get(**kw)
        assert e.value.field == field
    finally:
        cache.close()


def test_the_plan_counts_the_cache_a_generation_and_the_child(tok):
    assert plan_bytes(tok.vocab_size, 8 << 20) > 8 << 20
    assert plan_bytes(151_936) - plan_bytes(4096) > 512 * (151_936 - 4096) // 8  # masks of a larger vocabulary
