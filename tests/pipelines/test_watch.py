"""The Watch: a run's cycles as events (its tree, the path kept, the spans), bounded, per client,
and the run's output unchanged by being watched."""

from __future__ import annotations

import json

import numpy as np
import pytest

import lever
from lever.dataflow.messages import Accepted, PassTiming, TokenTree
from lever.dataflow.trace import Span
from lever.pipelines.watch import MAX_NODES, Watch, cycle_event
from lever.shipped import shipped
from tests.sizes import cases


def piece(t: int) -> str:
    return f"<{t}>"


def strict(text: str) -> dict:
    """JSON with every number finite (NaN and Infinity refused)."""
    def refuse(name):
        raise AssertionError(f"{name} in an event")
    return json.loads(text, parse_constant=refuse)


def test_the_ring_is_bounded_in_bytes_and_says_what_a_slow_reader_missed():
    w = Watch(piece, max_bytes=1000)
    for i in range(100):
        w.push(None, {"type": "x", "i": i, "pad": "." * 30})
    assert w.n_bytes <= 1000
    found, newest, missed = w.since(0)
    assert newest == 100
    assert [strict(e.data)["i"] for e in found] == list(range(100 - len(found), 100))
    assert missed == 100 - len(found) > 0
    assert w.since(newest) == ([], 100, 0)
    assert w.since(newest - 3)[0][0].seq == newest - 2


def test_a_reader_sees_only_its_own_clients_runs():
    w = Watch(piece)
    for who in ("a", "b", None, "a"):
        w.push(who, {"who": who})
    assert [strict(e.data)["who"] for e in w.since(0, "a")[0]] == ["a", "a"]
    assert [strict(e.data)["who"] for e in w.since(0, None)[0]] == [None]
    assert w.since(0, "c")[0] == []


def tree_and_cycle(gains=None) -> tuple[TokenTree, Accepted]:
    # root 0 -> 1 -> 3, root -> 2; the target took 1 and 3, then said its own token 9
    tree = TokenTree(5, np.array([7, 8, 6, 4], np.int64), np.array([-1, 0, 0, 1], np.int32),
                     gains=np.array([1.0, 0.8, 0.1, 0.5], np.float32) if gains is None else gains,
                     q=np.array([1.0, 0.8, 0.1, 0.6], np.float32))
    acc = Accepted(5, (8, 4, 9), (0, 1, 3), pruned=(2,), drafted_kept=2, tree=tree,
                   timing=PassTiming(4, 0.004, 0.001, 0.003, 2_000_000, accept_s=0.0005))
    return tree, acc


def test_a_cycle_event_draws_the_tree_the_path_kept_and_the_flash_busy_share():
    _, acc = tree_and_cycle()
    spans = [Span("prefetch", "read", 0.0, 0.002, "io"), Span("prefetch", "read", 0.001, 0.003, "io"),
             Span("prefetch", "read", 0.005, 0.006, "io"), Span("verify", "layer 0", 0.003, 0.007, "compute")]
    ev = strict(json.dumps(cycle_event(acc, piece, spans, start_s=0.0, end_s=0.010)))
    assert [(n["parent"], n["text"], n["state"]) for n in ev["nodes"]] == [
        (-1, "<7>", "kept"), (0, "<8>", "kept"), (0, "<6>", "pruned"), (1, "<4>", "kept")]
    assert ev["emitted"] == ["<8>", "<4>", "<9>"] and ev["own"] == 1 and ev["n_drafted"] == 3
    assert ev["flash_busy"] == pytest.approx(0.4)  # reads under way in [0, 3] and [5, 6] of 10 ms
    assert ev["cycle_ms"] == pytest.approx(10.0)
    assert ev["timing"]["read_mb"] == 2.0
    assert [s["end_ms"] for s in ev["spans"]] == [2.0, 3.0, 6.0, 7.0]


def test_a_gain_that_is_not_finite_is_null_and_a_prefill_draws_no_nodes():
    _, acc = tree_and_cycle(gains=np.array([1.0, np.nan, np.inf, 0.5], np.float32))
    ev = strict(json.dumps(cycle_event(acc, piece, [], start_s=0.0, end_s=0.01)))
    assert [n["gain"] for n in ev["nodes"]] == [1.0, None, None, 0.5]
    prompt = TokenTree.chain(0, list(range(2, 402)))
    ev = cycle_event(Accepted(0, (3,), tuple(range(400)), tree=prompt), piece, [], start_s=0.0, end_s=0.01)
    assert ev["nodes"] == [] and ev["n_given"] == 400


def test_a_big_tree_is_drawn_to_max_nodes():
    n = MAX_NODES + 40
    tree = TokenTree(1, np.arange(n, dtype=np.int64), np.arange(-1, n - 1, dtype=np.int32))
    ev = cycle_event(Accepted(1, (1, 2), (0, 1), drafted_kept=1, tree=tree), piece, [], start_s=0, end_s=1)
    assert len(ev["nodes"]) == MAX_NODES and ev["n_nodes"] == n


@pytest.fixture(scope="module")
def llm():
    with lever.load(shipped("default.toml")) as m:
        yield m


def test_a_watched_run_is_the_same_run_and_its_kept_paths_spell_its_tokens(llm):
    prompt = "def parse_args(argv):"
    plain = llm.generate(prompt, max_tokens=40)
    tok = llm.tokenizer
    llm.watch = w = Watch(lambda t: tok.token_bytes(t).decode("utf-8", "replace"))
    try:
        llm.generate(prompt, max_tokens=8)  # nobody reads: the run's start and end only
        assert [json.loads(e.data)["type"] for e in w.since(0)[0]] == ["run", "end"]
        w.readers = 1
        start = w.since(2**62)[1]
        watched = llm.generate(prompt, max_tokens=40)
    finally:
        llm.watch = None
    assert watched.tokens == plain.tokens
    events = [strict(e.data) for e in w.since(start)[0]]
    assert [e["type"] for e in events[:2]] == ["run", "cycle"] and events[-1]["type"] == "end"
    assert events[0]["n_prompt"] == len(tok.encode(prompt))
    cycles = [e for e in events if e["type"] == "cycle"]
    assert [c["pass"] for c in cycles] == list(range(len(cycles)))
    assert sum(len(c["emitted"]) for c in cycles) == len(plain.tokens) == events[-1]["n_tokens"]
    decode = cycles[1:]
    assert decode and all(c["nodes"] for c in decode)
    trees = {e["pass"]: e for e in events if e["type"] == "tree"}  # each pass's tree as verification began
    assert sorted(trees) == [c["pass"] for c in decode]
    for c in decode:
        before = trees[c["pass"]]["nodes"]
        assert [(n["parent"], n["text"]) for n in before] == [(n["parent"], n["text"]) for n in c["nodes"]]
        assert [n["state"] for n in before] == ["kept"] + ["drafted"] * (len(before) - 1)
        at = {(e["type"], e.get("pass")): i for i, e in enumerate(events)}
        assert at[("tree", c["pass"])] < at[("cycle", c["pass"])]  # its tree came before its cycle
    for c in decode:
        kept = [n["text"] for n in c["nodes"][1:] if n["state"] == "kept"]
        assert kept + c["emitted"][len(kept):] == c["emitted"] and len(kept) == c["drafted_kept"]
        assert c["own"] == 1 or c["done"]
        assert 0 <= c["flash_busy"] <= 1 and c["spans"]
    assert {s["stage"] for c in decode for s in c["spans"]} >= {"prefetch", "verify", "accept", "draft"}


def test_each_clients_sequence_is_its_own():
    """Events of several clients interleaved at random: a client's numbers run 1, 2, 3 ...
    whatever the others push, its newest and missed counts are its own, and nothing it reads
    moves with another's runs."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=cases(100), deadline=None)
    @given(st.lists(st.sampled_from(["a", "b", None]), max_size=200), st.integers(200, 4000))
    def check(pushes, max_bytes):
        w = Watch(lambda t: str(t), max_bytes=max_bytes)
        counts = {"a": 0, "b": 0, None: 0}
        for who in pushes:
            counts[who] += 1
            assert w.push(who, {"who": who}) == counts[who]
        for who, n in counts.items():
            found, newest, missed = w.since(0, who)
            assert newest == n and [e.seq for e in found] == list(range(missed + 1, n + 1))
            assert all(e.client == who for e in found)

    check()
