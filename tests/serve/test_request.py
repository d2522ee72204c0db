"""lever.serve.request: a body bounded before it is read, fields Lever does not honour refused by
name, nesting refused in one line."""

from __future__ import annotations

import json
import time

import anyio
import pytest
from starlette.requests import Request

from lever.serve.pool import RequestPool
from lever.serve.rate import BodyRate
from lever.serve.request import CLOSING_POLL_S, MAX_BODY_BYTES, BadRequest, parse, read_body, sampling
from tests.load import within
from tests.sizes import cases


def _request(headers: dict, chunks: list[bytes], delay_s: float = 0.0):
    """A Request whose body arrives in `chunks` (each after `delay_s`); `sent["n"]` counts the receives answered."""
    sent = {"n": 0}

    async def receive():  # as uvicorn's: cancelled while it waits, it loses nothing
        if delay_s:  # the next chunk arrives delay_s after the one before was taken, whoever waits
            sent.setdefault("at", anyio.current_time() + delay_s)
            await anyio.sleep(max(sent["at"] - anyio.current_time(), 0))
            sent["at"] = anyio.current_time() + delay_s
        sent["n"] += 1
        i = sent["n"] - 1
        more = i + 1 < len(chunks)
        return {"type": "http.request", "body": chunks[i] if i < len(chunks) else b"", "more_body": more}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope, receive), sent


def _read(req, **kw):
    """The body read into a fresh pool's hold; the hold, to look at after."""
    hold = RequestPool().hold("c")
    return anyio.run(lambda: read_body(req, hold=hold, **kw)), hold


def test_a_declared_length_over_the_bound_is_refused_before_a_byte_is_read():
    req, sent = _request({"content-length": str(500 << 20)}, [b"x" * 1024] * 4)
    with pytest.raises(BadRequest, match="524288000 bytes, over the bound") as e:
        _read(req, timeout_s=5)
    assert e.value.status == 413 and sent["n"] == 0


def test_a_body_that_lies_about_its_length_is_cut_at_the_bound():
    req, sent = _request({"content-length": "10"}, [b"x" * (1 << 20)] * 8)
    with pytest.raises(BadRequest) as e:
        _read(req, timeout_s=5, max_bytes=2 << 20)
    assert e.value.status == 413 and sent["n"] == 3  # stopped at the chunk that passed the bound


def test_a_slow_body_times_out():
    req, _ = _request({}, [b"{"] * 100, delay_s=0.05)
    with pytest.raises(BadRequest, match="took over 0.3 s") as e:
        _read(req, timeout_s=0.3)
    assert e.value.status == 408


def test_a_stalled_body_is_cut_before_the_timeout():
    req, _ = _request({}, [b"{"] * 3, delay_s=1.0)
    with pytest.raises(BadRequest, match="stalled for 0.2 s") as e:
        _read(req, timeout_s=60, idle_s=0.2)
    assert e.value.status == 408


@pytest.mark.parametrize("waiting_on", ["its next chunk", "its rate"])
def test_a_body_still_arriving_when_the_server_closes_gets_503_at_once(waiting_on):
    if waiting_on == "its next chunk":  # a chunk every second
        req, sent = _request({}, [b"{"] * 100, delay_s=1.0)
        rate = None
    else:  # every chunk at once, paid for at 1 kB/s
        req, sent = _request({}, [b"{" * 1000] * 100)
        rate = BodyRate(rate_bytes_per_s=1000, burst_bytes=1000)
    t0 = time.monotonic()
    with pytest.raises(BadRequest) as e:
        _read(req, timeout_s=600, rate=rate, closing=lambda: time.monotonic() > t0 + 0.1)
    assert e.value.status == 503 and "shutting down" in e.value.message
    assert sent["n"] < 100 and within(time.monotonic() - t0 - 0.1, 2 * CLOSING_POLL_S)


def test_a_body_within_its_bounds_is_read_whole_and_held_as_it_arrived():
    req, _ = _request({"content-length": "4000000"}, [b"ab", b"cd", b"ef"])  # declares 4 MB, sends 6 bytes
    body, hold = _read(req, timeout_s=5)
    assert body == b"abcdef" and hold.nbytes == 12  # the chunks and the body they join into, not the declared


@pytest.mark.parametrize("field, value", [
    ("echo", True), ("best_of", 2), ("functions", [{"name": "f"}]), ("suffix", "x"),
])
def test_a_field_lever_does_not_honour_is_refused_by_name(field, value):
    with pytest.raises(BadRequest, match=f"^{field}: not supported") as e:
        parse(json.dumps({"prompt": "x", field: value}).encode(), "completions")
    assert e.value.param == field and e.value.status == 400


@pytest.mark.parametrize("extra", [
    {"echo": False}, {"tools": []}, {"n": None}, {"n": 1},
    {"tool_choice": "none"}, {"frequency_penalty": 0}, {"user": "me"},
])
def test_defaults_of_unhonoured_fields_pass(extra):
    assert parse(json.dumps({"prompt": "x", **extra}).encode(), "completions")["prompt"] == "x"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("extra", [
    {"presence_penalty": 0.5}, {"frequency_penalty": -1}, {"logit_bias": {"15": -100, " the": False}},
    {"logit_bias": [[15, -100], [" the", False]]}, {"ignore_eos": True}, {"ignore_eos": False},
    {"logit_bias": [], "presence_penalty": 0, "frequency_penalty": 0},  # OpenAI's clients' defaults
])
def test_the_bias_and_the_penalties_reach_the_call_as_sent(endpoint, extra):
    """Checked as a call's arguments by lever.api.call (the forms, the vocabulary, the bounds)."""
    body = {"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    assert sampling(parse(json.dumps({**body, **extra}).encode(), endpoint), endpoint) == extra


@pytest.mark.parametrize("extra, field, words", [
    ({"logit_bias": "the"}, "logit_bias", "must be a list or an object"),
    ({"logit_bias": 3}, "logit_bias", "must be a list or an object"),
    ({"ignore_eos": 1}, "ignore_eos", "must be a boolean"),
    ({"presence_penalty": "0.5"}, "presence_penalty", "must be an integer or a number"),
    ({"frequency_penalty": True}, "frequency_penalty", "must be an integer or a number"),
])
def test_the_bias_and_the_penalties_of_a_wrong_type_are_refused_by_name(extra, field, words):
    with pytest.raises(BadRequest, match=f"^{field}: {words}") as e:
        parse(json.dumps({"prompt": "x", **extra}).encode(), "completions")
    assert e.value.param == field and e.value.status == 400


@pytest.mark.parametrize("endpoint, extra, args", [
    ("completions", {"logprobs": 3}, {"logprobs": 3}), ("completions", {"logprobs": True}, {"logprobs": 0}),
    ("completions", {"logprobs": False}, {}), ("completions", {"logprobs": None}, {}),
    ("chat", {"logprobs": True, "top_logprobs": 5}, {"logprobs": 5}), ("chat", {"logprobs": True}, {"logprobs": 0}),
    ("chat", {"logprobs": False}, {}),
])
def test_logprobs_reach_the_call_as_a_count_of_alternatives(endpoint, extra, args):
    body = {"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    assert sampling(parse(json.dumps({**body, **extra}).encode(), endpoint), endpoint) == args


@pytest.mark.parametrize("extra, words", [
    ({"logprobs": 3}, "logprobs: must be a boolean"), ({"top_logprobs": 2}, "top_logprobs: needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": "2"}, "top_logprobs: must be an integer"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: must be in \\[0, 20\\], got 21"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs: must be in"),
    ({"logprobs": True, "top_logprobs": 10**9}, "top_logprobs: must be in"),
])
def test_chat_logprobs_are_checked_by_name(extra, words):
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(BadRequest, match=words):
        parse(json.dumps(body).encode(), "chat")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("extra, want", [
    ({"response_format": {"type": "json_object"}}, {"json_schema": {"type": "object"}}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     {"json_schema": SCHEMA}),
    ({"response_format": {"type": "text"}}, {}), ({"json_schema": SCHEMA}, {"json_schema": SCHEMA}),
    ({"grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
])
def test_structured_output_fields_reach_the_call(extra, want):
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    assert sampling(parse(json.dumps(body).encode(), "chat"), "chat") == want


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "json_schema": SCHEMA}, "json_schema"),
    ({"response_format": {"type": "json_object"}, "grammar": "start: /a/"}, "grammar"),
    ({"response_format": "json"}, "response_format"),
])
def test_structured_output_fields_are_checked_by_name(extra, param):
    with pytest.raises(BadRequest) as e:
        parse(json.dumps({"prompt": "x", **extra}).encode(), "completions")
    assert e.value.param == param and e.value.status == 400


def test_deep_nesting_is_one_line():
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert len(body) < MAX_BODY_BYTES
    with pytest.raises(BadRequest, match="nests too deep"):
        parse(body, "completions")


def test_only_the_fields_read_are_kept():
    fat = {"prompt": "hi", "max_tokens": 3, "metadata": [{}] * 1000, "user": "u"}
    assert parse(json.dumps(fat).encode(), "completions") == {"prompt": "hi", "max_tokens": 3, "user": "u",
                                                                 "json_schema": None}


def _values(leaf):
    from hypothesis import strategies as st
    def nest(inner):
        return st.lists(inner, max_size=40) | st.dictionaries(st.text(max_size=6), inner, max_size=12)
    return st.recursive(leaf, nest, max_leaves=400)


def _leaves():
    from hypothesis import strategies as st
    return (st.none() | st.booleans() | st.integers() | st.integers(min_value=1 << 40) | st.floats(allow_nan=False,
            allow_infinity=False) | st.text(max_size=30) | st.text(alphabet="\U0001F600é\\\"\n x", max_size=30)
            | st.just({}) | st.just([]))


def test_parsing_never_takes_more_than_parse_bytes_says():
    """Over generated JSON (nests of empty objects, astral and escaped strings, big numbers,
    distinct keys, as the attacks that took 100 MB used), what json.loads allocates, measured,
    stays within parse_bytes: what the pool holds before a body is parsed is a bound."""
    import tracemalloc

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from lever.serve.request import parse_bytes

    fat = st.sampled_from([b"{}", b"[]", b'{"k":0}', b"1.5", b"123456789", b'"ab"', b'"\\ud83d\\ude00"', b"null"])

    @settings(max_examples=cases(150), deadline=None, suppress_health_check=list(HealthCheck))
    @given(_values(_leaves()), fat, st.integers(0, 20_000), st.booleans())
    def check(value, item, n, wide):
        body = json.dumps({"v": value, "pad": None}, ensure_ascii=not wide).encode()
        body = body[:-5] + b"[" + b",".join([item] * n) + b"]}"  # the pad: n copies of one fat item
        tracemalloc.start()
        try:
            json.loads(body)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= parse_bytes(body), (len(body), peak, parse_bytes(body))

    check()
