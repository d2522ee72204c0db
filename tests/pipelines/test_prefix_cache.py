"""Several conversations kept (lever.pipelines.prefix_cache): rows copied out and back give the
same tokens as a fresh prefill, a returning conversation prefills only what is new, a client
never gets another's rows, and the bytes stay within the bound, oldest out first."""

from __future__ import annotations

import numpy as np
import pytest

import lever
from lever.pipelines.compose import KVState
from lever.pipelines.prefix_cache import MIN_REUSE_TOKENS, KVSnapshot, PrefixCache, shared
from lever.shipped import shipped
from tests.sizes import cases

A = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
B = "class Stack:\n    def __init__(self):\n        self.items = []\n"


@pytest.fixture(scope="module")
def llm():
    with lever.load(shipped("default.toml")) as m:
        yield m


class Cache:  # a KVCache's shape, small
    def __init__(self, n_rows: int, fill: float):
        self.k = [np.full((16, 2, 4), fill, np.float16) for _ in range(2)]
        self.v = [np.full((16, 2, 4), -fill, np.float16) for _ in range(2)]
        self.n_rows = n_rows


def snap(ids, fill=1.0) -> KVSnapshot:
    return KVSnapshot.of(KVState(Cache(len(ids), fill), None, len(ids)), ids)


def test_the_longest_shared_prefix_of_the_clients_own_comes_back():
    c = PrefixCache(1 << 20)
    c.put("k1", snap(list(range(12))))
    c.put("k1", snap([*range(10), 99, 98], fill=2.0))
    c.put("k2", snap(list(range(16))))
    got = c.take("k1", [*range(11), 7])
    assert got is not None and got.ids == tuple(range(12)) and len(c.entries) == 2  # it left the cache
    assert c.take("k1", [50, 51, 52]) is None  # nothing shared
    assert c.take("k3", list(range(16))) is None  # another client's rows are never reused
    assert c.take("k1", list(range(10)), at_least=10) is None  # the live caches already share as much
    assert shared([1, 2, 3], [1, 2, 4]) == 2 and shared([], [1]) == 0 and MIN_REUSE_TOKENS > 1


def test_bytes_stay_within_the_bound_oldest_out_first():
    one = snap(list(range(10))).nbytes
    c = PrefixCache(3 * one)
    for i in range(5):
        c.put("k", snap([i, *range(100, 109)]))
    assert len(c.entries) == 3 and c.used_bytes == 3 * one
    assert [s.ids[0] for s in c.entries.values()] == [2, 3, 4]
    big = PrefixCache(one - 1)
    big.put("k", snap(list(range(10))))
    assert not big.entries and big.used_bytes == 0  # bigger than the whole bound: not kept


def test_restored_rows_give_the_tokens_a_fresh_prefill_gives(llm):
    with llm.session() as s:
        s.cache = PrefixCache(64 << 20)
        a1 = s.generate(A, max_tokens=12)
        b1 = s.generate(B, max_tokens=12)  # takes the caches: A's rows go to the cache
        assert len(s.cache.entries) == 1 and b1.usage.cached_tokens <= 1  # a BOS at most
        a_next = A + a1.text + "\n"
        a2 = s.generate(a_next, max_tokens=12)  # A comes back from the cache
        assert a2.usage.cached_tokens >= len(llm.tokenizer.encode(A)) and s.cache.hits == 1
        assert a2.tokens == llm.generate(a_next, max_tokens=12).tokens  # lossless
        b_next = B + b1.text + "\n"
        assert s.generate(b_next, max_tokens=12).usage.cached_tokens > 0  # and B from it in turn


def test_a_client_never_gets_anothers_rows(llm):
    with llm.session() as s:
        s.cache = PrefixCache(64 << 20)
        first = llm.run(llm.prepare(A, max_tokens=8), session=s, client="alice")
        other = llm.run(llm.prepare(A, max_tokens=8), session=s, client="bob")
        again = llm.run(llm.prepare(A, max_tokens=8), session=s, client="alice")
        assert first.usage.cached_tokens == 0 and other.usage.cached_tokens == 0
        assert again.usage.cached_tokens > 0 and again.tokens == first.tokens


def test_a_clients_puts_never_push_out_anothers_entries():
    """Any sequence of puts and takes by three clients over a cache split in three: what one
    client holds changes only by its own calls, each client keeps within its share, and
    every client's oldest leave first."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    one = snap(list(range(10))).nbytes

    @settings(max_examples=cases(150), deadline=None)
    @given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.integers(0, 40)), max_size=60))
    def check(ops):
        c = PrefixCache(3 * 3 * one, shares=3)  # three entries a client
        for client, put, x in ops:
            before = {k: v for k, v in c.entries.items() if k[0] != client}
            if put:
                c.put(client, snap([x, *range(100, 109)]))
            else:
                c.take(client, [x, *range(100, 109)])
            assert {k: v for k, v in c.entries.items() if k[0] != client} == before
            for who in "abc":
                assert sum(s.nbytes for k, s in c.entries.items() if k[0] == who) <= c.share_bytes
            assert c.used_bytes == sum(s.nbytes for s in c.entries.values())

    check()


def test_the_same_prompt_again_is_kept_once():
    c = PrefixCache(1 << 20)
    for _ in range(5):
        c.put("k", snap(list(range(10))))
    c.put("k", snap([*range(10), 5, 6]))  # a longer one that begins with it takes its place
    c.put("k", snap([7, 8, 9]))
    assert [s.ids for s in c.entries.values()] == [(*range(10), 5, 6), (7, 8, 9)]
    assert c.used_bytes == sum(s.nbytes for s in c.entries.values())


def test_a_resize_keeps_each_clients_newest_within_its_new_share_and_never_passes_the_plan():
    rng = np.random.default_rng(50)
    one = snap(list(range(10))).nbytes
    for _ in range(30):
        c = PrefixCache(int(rng.integers(4, 12)) * one, shares=int(rng.integers(1, 4)))
        for i in range(int(rng.integers(5, 30))):
            c.put(f"k{rng.integers(0, 3)}", snap([i, *range(100, 109)]))
        before = {k: s.ids[0] for k, s in c.entries.items()}
        want = int(rng.integers(0, 2 * c.planned_bytes))
        c.resize(want)
        assert c.capacity_bytes == min(want, c.planned_bytes)
        assert c.used_bytes == sum(s.nbytes for s in c.entries.values())
        for client in {k[0] for k in before}:
            mine = [k for k in before if k[0] == client]
            kept = [k for k in c.entries if k[0] == client]
            assert sum(c.entries[k].nbytes for k in kept) <= c.share_bytes
            assert kept == mine[len(mine) - len(kept):]  # the newest stayed, in order
            # none left that its share had room for
            assert len(kept) == min(len(mine), c.share_bytes // one)
