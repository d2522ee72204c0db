"""lever.api.lanes: at most n generations at once, each session's calls one at a time, every
lane taken back before the engine closes."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from lever.api.lanes import Lanes
from tests.sizes import cases


class _Session:  # what a lane holds of a session: its lock
    def __init__(self):
        self.lock = threading.Lock()


@settings(max_examples=cases(30), deadline=None)
@given(n=st.integers(1, 4), sessions=st.lists(st.integers(-1, 3), min_size=1, max_size=10))
def test_n_generations_at_once_never_more_and_one_per_session(n, sessions):
    """Calls arriving at once (-1: no session, else which one): never more than n run together,
    never two in one session, and n do when enough calls in distinct sessions wait."""
    lanes, cond = Lanes(n), threading.Condition()
    own = {s: _Session() for s in set(sessions) if s >= 0}
    inside, by_session, most, clash, started = [0], {}, [0], [], [0]
    distinct = sessions.count(-1) + len(own)

    def one(s: int):
        with lanes.hold(own.get(s)) as batcher:
            assert batcher is None
            with cond:
                inside[0] += 1
                started[0] += 1
                most[0] = max(most[0], inside[0])
                by_session[s] = by_session.get(s, 0) + 1
                if s >= 0 and by_session[s] > 1:
                    clash.append(s)
                assert lanes.running == inside[0] and lanes.busy == (inside[0] >= n)
                cond.notify_all()
                cond.wait_for(lambda: started[0] >= min(n, distinct), 10)
                inside[0] -= 1
                by_session[s] -= 1

    threads = [threading.Thread(target=one, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert most[0] <= n and not clash and lanes.running == 0
    assert most[0] == min(n, distinct)


def test_all_waits_for_every_lane():
    lanes, inside, release = Lanes(2), threading.Event(), threading.Event()

    def generation():
        with lanes.hold(None):
            inside.set()
            release.wait(30)

    t = threading.Thread(target=generation)
    t.start()
    inside.wait(30)
    took = threading.Event()
    closer = threading.Thread(target=lambda: (lanes.all().__enter__(), took.set()))
    closer.start()
    assert not took.wait(0.2)  # a generation runs: closing waits
    release.set()
    assert took.wait(30)
    t.join(30)
    closer.join(30)
