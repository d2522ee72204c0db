"""lever.serve.pool: what requests hold, in total and per client, from first byte to end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever.serve.pool import RequestPool
from lever.serve.request import BadRequest
from tests.sizes import cases


def test_a_client_holds_at_most_its_share_and_another_still_finds_room():
    pool = RequestPool(capacity_bytes=1000, share=0.5)
    greedy = [pool.hold("a") for _ in range(6)]
    for h in greedy[:5]:
        h.add(100)
    with pytest.raises(BadRequest, match="its share is") as e:
        greedy[5].add(100)  # past a's 500
    assert e.value.status == 503 and pool.held("a") == 500
    other = pool.hold("b")
    other.add(400)  # b is served beside a's full share
    assert pool.used_bytes == 900
    for h in greedy:
        h.release()
    other.release()
    assert pool.used_bytes == 0 and pool.held("a") == pool.held("b") == 0


def test_a_request_that_can_never_fit_is_413_not_busy():
    pool = RequestPool(capacity_bytes=1000, share=0.5)
    with pool.hold("a") as h, pytest.raises(BadRequest, match="too large for this server") as e:
        h.set(600, "tokenizing its prompt")
    assert e.value.status == 413 and pool.used_bytes == 0


@settings(max_examples=cases(200), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["add", "set", "release"]), st.integers(0, 400)),
                max_size=80))
def test_the_counts_add_up_and_never_pass_the_bounds(ops):
    """Any interleaving of requests (6 holds, 3 clients) growing, shrinking and ending: the
    pool's count is the sum of the holds, no client past its share, the whole within capacity,
    and a refusal changes nothing."""
    pool = RequestPool(capacity_bytes=1000, share=0.5)
    holds = [pool.hold(f"c{i % 3}") for i in range(6)]
    for i, op, n in ops:
        h, before = holds[i], holds[i].nbytes
        try:
            if op == "add":
                h.add(n)
            elif op == "set":
                h.set(n, "test")
            else:
                h.release()
        except BadRequest:
            assert h.nbytes == before
        assert pool.used_bytes == sum(x.nbytes for x in holds) <= pool.capacity_bytes
        for c in ("c0", "c1", "c2"):
            assert pool.held(c) == sum(x.nbytes for x in holds if x.client == c) <= pool.client_bytes
    for h in holds:
        h.release()
    assert pool.used_bytes == 0


@pytest.mark.parametrize("cache_mib, page", [(0, False), (4, True)])
def test_the_server_holds_the_parts_its_command_plans_for(cache_mib, page):
    """`lever serve --mem` plans the run within what `server_parts` leaves; the server app()
    builds holds exactly those parts (its memory_plan reads them off its objects)."""
    import lever
    from lever.pipelines.watch import LIVE_BYTES
    from lever.serve import app
    from lever.serve.pool import server_parts
    from lever.shipped import shipped

    with lever.load(shipped("default.toml")) as llm:
        asgi = app(llm, model_id="m", cache_bytes=cache_mib << 20, page=page)
        plan = asgi.app.state.server.memory_plan()
        asgi.app.state.server.prep.close()
    assert {k: v for k, v in plan.items() if k != "run"} == server_parts(
        cache_bytes=cache_mib << 20, live_bytes=LIVE_BYTES if page else 0)
