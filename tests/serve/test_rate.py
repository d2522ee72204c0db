"""lever.serve.rate: one client's bodies are read no faster than its rate past a burst, clients
apart; a body its rate cannot bring in time is refused at once, unread."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.serve.pool import RequestPool
from lever.serve.rate import BodyRate
from lever.serve.request import BadRequest, read_body
from tests.serve.test_request import _request
from tests.sizes import cases

RATE, BURST = 1000.0, 500  # bytes a second, bytes at once


@settings(max_examples=cases(300), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 400), st.floats(0, 0.5)), max_size=60))
def test_what_a_client_is_let_read_never_passes_its_burst_and_rate(arrivals):
    """Chunks of four clients arriving over time, each read once it is due: by any moment a client
    has been let read at most BURST + RATE x the time since its first chunk, and a chunk within
    what its bucket holds is due at once."""
    rate = BodyRate(rate_bytes_per_s=RATE, burst_bytes=BURST)
    now, first, read, paid_to = 0.0, {}, {}, {}
    for client, nbytes, dt_s in arrivals:
        now += dt_s
        start = max(now, paid_to.get(client, now))  # a client reads its next chunk only once the last is paid
        first.setdefault(client, start)
        owed_s = max(paid_to.get(client, -1e9) - (start - BURST / RATE), 0.0)  # of its burst, spent
        due = rate.due(client, nbytes, start)
        read[client] = read.get(client, 0) + nbytes
        paid_to[client] = max(due, start)
        assert read[client] <= BURST + RATE * (paid_to[client] - first[client]) + 1e-6
        if owed_s * RATE + nbytes <= BURST:  # within what its bucket holds
            assert due <= start + 1e-9


def test_clients_are_apart():
    rate = BodyRate(rate_bytes_per_s=RATE, burst_bytes=BURST)
    assert rate.due("a", 5000, 0.0) == pytest.approx(4.5)  # 500 at once, 4,500 at 1,000 a second
    assert rate.due("b", 100, 0.0) <= 0.0  # b's bucket is its own


def _read(chunks: list[bytes], rate: BodyRate, client: str = "c", timeout_s: float = 30):
    req, sent = _request({}, chunks)
    hold = RequestPool().hold(client)

    async def main():
        t0 = anyio.current_time()
        body = await read_body(req, hold=hold, timeout_s=timeout_s, rate=rate)
        return body, anyio.current_time() - t0

    return anyio.run(main), sent


def test_a_body_past_the_burst_is_read_at_the_rate():
    rate = BodyRate(rate_bytes_per_s=20_000, burst_bytes=2_000)
    (body, took_s), _ = _read([b"x" * 1000] * 6, rate)  # 4,000 past the burst: 0.2 s at least
    assert body == b"x" * 6000 and took_s >= 0.2 - 0.01  # a lower bound: holds on a loaded machine


def test_a_body_its_rate_cannot_bring_in_time_is_refused_unread():
    rate = BodyRate(rate_bytes_per_s=1000, burst_bytes=1000)
    with pytest.raises(BadRequest, match="at this client's rate") as e:
        _read([b"x" * 1000] * 100, rate, timeout_s=1.0)  # 100 s at its rate: cut at its third chunk
    assert e.value.status == 408
    req, sent = _request({}, [b"x" * 1000] * 100)
    with pytest.raises(BadRequest) as e:  # its client owes (2 s from the first) past this one's deadline
        anyio.run(lambda: read_body(req, hold=RequestPool().hold("c"), timeout_s=0.5, rate=rate))
    assert e.value.status == 408 and sent["n"] == 0
    (body, _), _ = _read([b"{}"], rate, client="other")  # another client is read at once
    assert body == b"{}"
