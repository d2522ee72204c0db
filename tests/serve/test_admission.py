"""lever.serve.admission: the queue's places, a client's share of them, the model's turns
going round the clients waiting (n at once), and the slots holding the generations that run."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.api import Cancelled
from lever.serve.admission import Admission, Slots, Turns
from lever.serve.request import BadRequest
from tests.sizes import cases


def test_one_client_gets_half_the_places_and_another_still_gets_in():
    a = Admission(queue=8, shared=True)  # nine places: one running, eight waiting
    for _ in range(a.client_share):
        a.admit("mallory")
    with pytest.raises(BadRequest, match="its share") as e:
        a.admit("mallory")
    assert e.value.status == 429
    a.admit("bob")
    a.release("mallory")
    a.admit("mallory")  # a place given back is hers again
    assert a.admitted == a.client_share + 1
    alone = Admission(queue=8)  # one key (or none): nobody else to keep room for
    for _ in range(9):
        alone.admit("bob")


def _served_order(arrivals: list[str]) -> list[str]:
    """Requests arriving in this order while the model is busy: the order their turns come."""
    turns, order, hold, started = Turns(), [], threading.Event(), threading.Event()

    def first():
        with turns.turn("first", threading.Event()):
            started.set()
            hold.wait(30)

    def one(client: str):
        with turns.turn(client, threading.Event()):
            order.append(client)

    t0 = threading.Thread(target=first)
    t0.start()
    started.wait(30)
    threads = []
    for c in arrivals:  # queued one after another, each surely waiting before the next comes
        t = threading.Thread(target=one, args=(c,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 30
        while sum(len(q) for q in turns._waiting.values()) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.001)
    hold.set()
    for t in [t0, *threads]:
        t.join(30)
    return order


def _round_robin(arrivals: list[str]) -> list[str]:
    """The order the rule gives when all have arrived before the first turn: the clients in the
    order they first came, one request each a round, each client's in its own order."""
    left = {c: arrivals.count(c) for c in arrivals}
    rounds, order = list(dict.fromkeys(arrivals)), []
    while rounds:
        c = rounds.pop(0)
        order.append(c)
        left[c] -= 1
        if left[c]:
            rounds.append(c)
    return order


@settings(max_examples=cases(25), deadline=None)
@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=12))
def test_turns_go_round_the_clients_first_come_first_served_within_each(arrivals):
    """Requests queued behind a running one, in any order: their turns go round the clients
    (one each a round), so a client that queued many waits no one behind all of its own."""
    assert _served_order(arrivals) == _round_robin(arrivals)


def test_a_waiting_turn_cancelled_leaves_and_the_next_goes_on():
    turns, cancel, started, hold = Turns(), threading.Event(), threading.Event(), threading.Event()

    def first():
        with turns.turn("a", threading.Event()):
            started.set()
            hold.wait(30)

    t = threading.Thread(target=first)
    t.start()
    started.wait(30)
    out = []

    def waiter():
        try:
            with turns.turn("b", cancel):
                out.append("ran")
        except Cancelled:
            out.append("cancelled")

    w = threading.Thread(target=waiter)
    w.start()
    cancel.set()
    w.join(30)
    hold.set()
    t.join(30)
    assert out == ["cancelled"] and not turns._waiting
    with turns.turn("c", threading.Event()):
        pass


@settings(max_examples=cases(20), deadline=None, database=None)
@given(n=st.integers(1, 4), clients=st.lists(st.sampled_from("abc"), min_size=1, max_size=10))
def test_n_turns_run_at_once_never_more(n, clients):
    """Generations of any clients arriving at once: never more than n hold a turn together, and
    n do when enough wait (each holds it until n have started, or all have)."""
    turns, cond, inside, most, started = Turns(n), threading.Condition(), [0], [0], [0]

    def one(client: str):
        with turns.turn(client, threading.Event()):
            with cond:
                inside[0] += 1
                started[0] += 1
                most[0] = max(most[0], inside[0])
                cond.notify_all()
                cond.wait_for(lambda: started[0] >= min(n, len(clients)), 10)
                inside[0] -= 1

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most[0] == min(n, len(clients)) and not turns._waiting


def test_a_generation_takes_the_free_slot_that_holds_most_of_its_prompt():
    slots = Slots(4, n_ctx=64)
    held = {0: 3, 1: 9, 2: -1, 3: 9}.get  # slot 1 and 3 hold 9 tokens of the prompt, 2 another client's
    with slots.hold({"n_prompt_tokens": 12}, held) as first:
        with slots.hold({"n_prompt_tokens": 12}, held) as second:
            with slots.hold({"n_prompt_tokens": 12}, held) as third:
                assert (first, second, third) == (1, 3, 0)  # ties: the lowest
                assert [s["is_processing"] for s in slots.view()] == [True, True, False, True]
                assert slots.processing == 3
    assert slots.processing == 0


@settings(max_examples=cases(50), deadline=None, database=None)
@given(n=st.integers(1, 8), runs=st.integers(0, 5))
def test_slot_zero_shows_the_task_holding_its_turn_and_only_while_it_does(n, runs):
    slots = Slots(n, n_ctx=256)
    assert [s["id"] for s in slots.view()] == list(range(n)) and all(s["n_ctx"] == 256 for s in slots.view())
    for i in range(runs):
        with slots.hold({"n_prompt_tokens": 5 + i, "params": {"n_predict": 8}}):
            view = slots.view()
            assert [s["is_processing"] for s in view] == [True] + [False] * (n - 1)
            assert view[0]["id_task"] == i and view[0]["n_prompt_tokens"] == 5 + i
        assert not any(s["is_processing"] or "params" in s for s in slots.view())
    with pytest.raises(RuntimeError), slots.hold({}):  # a generation that fails frees its slot too
        raise RuntimeError
    assert not slots.view()[0]["is_processing"]
