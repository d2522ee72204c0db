"""`lever serve` as a client sees it: the real `openai` client against a server this test starts
on the shipped pair, its answers equal to the Python API's, a queue that refuses with 429 past
its length, and clients that leave freeing the server."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import psutil
import pytest

import lever
from lever.model.stop import StopReason
from lever.shipped import shipped
from tests.load import within
from tests.serve.live import JSON, QUEUE, start_server, stop

PROMPT = "def parse_args(argv):"
MESSAGES = [{"role": "user", "content": "import os"}]


def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["stdlib-target-q4_0"]
    assert httpx.get(server[1] + "/health").json()["status"] == "ok"


def test_completion_equals_the_api_and_counts_usage(client, llm):
    want = llm.generate(PROMPT, max_tokens=24)
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        want.usage.prompt_tokens, 24, want.usage.prompt_tokens + 24)


def test_a_stop_string_ends_the_completion(client, llm):
    full = llm.generate(PROMPT, max_tokens=24).text
    stop = full[8:11]
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=24, stop=[stop])
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(llm.generate(PROMPT, max_tokens=24, stop=stop).tokens)


def test_a_second_turn_reuses_the_conversations_prefix(client, llm):
    r1 = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16)
    turn2 = [*MESSAGES, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "import sys"}]
    r2 = client.chat.completions.create(model="x", messages=turn2, max_tokens=16)
    assert r2.choices[0].message.content == llm.chat(turn2, max_tokens=16).text
    assert 0 < r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens


def test_chat_and_streamed_chat_equal_the_api(client, llm):
    want = llm.chat(MESSAGES, max_tokens=24)
    r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=24)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want.tokens)
    parts, finish, usage = [], None, None
    for ev in client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=24, stream=True,
                                             stream_options={"include_usage": True}):
        if ev.usage is not None:
            usage = ev.usage
        for ch in ev.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == want.text and finish == "length"
    assert usage.completion_tokens == len(want.tokens) and usage.prompt_tokens == want.usage.prompt_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="x", prompt=PROMPT, max_tokens=24,
                                                                               stream=True) if c.choices)
    assert streamed == llm.generate(PROMPT, max_tokens=24).text


@pytest.mark.parametrize("body, param", [
    (b"{not json", None), (b"[1, 2]", None), (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature"), (b'{"prompt": 3}', "prompt"),
    (b'{"prompt": "x", "max_tokens": 2147483648}', "max_tokens"), (b'{"prompt": "x", "stop": 5}', "stop"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"), (b'{"prompt": "x", "n": 2}', "n"), (b'{}', "prompt"),
    (b'{"prompt": "x", "temperature": -1}', "temperature"),
])
def test_bad_requests_get_400_naming_the_field(server, body, param):
    r = httpx.post(server[1] + "/v1/completions", content=body, headers=JSON)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and "\n" not in err["message"]
    r = httpx.post(server[1] + "/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and "messages[0].content" in r.json()["error"]["message"]


def test_sixteen_clients_against_a_queue_of_four(server, llm):
    proc, url = server
    want = llm.generate(PROMPT, max_tokens=48).text
    rss_before = psutil.Process(proc.pid).memory_info().rss
    results = [None] * 16

    def one(i):
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 48}, timeout=120)
        results[i] = (r.status_code, r.json())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 429} and codes.count(200) >= QUEUE + 1 and 429 in codes, codes
    for code, body in results:
        if code == 200:
            assert body["choices"][0]["text"] == want
        else:
            assert body["error"]["type"] == "rate_limit_exceeded"
    assert httpx.get(url + "/health").json()["admitted"] == 0
    assert httpx.post(url + "/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 48}).json()["choices"][0]["text"] == want
    rss_after = psutil.Process(proc.pid).memory_info().rss
    assert rss_after <= rss_before * 1.1 + (32 << 20), (rss_before, rss_after)


def test_a_client_that_leaves_mid_stream_frees_the_server(server):
    url = server[1]
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 480, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    left = time.monotonic()
    deadline = left + 60
    while httpx.get(url + "/health").json()["admitted"] and time.monotonic() < deadline:
        time.sleep(0.05)
    freed_s = time.monotonic() - left
    assert within(freed_s, 1.0), f"the slot came back {freed_s:.2f} s after the client left"
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=10)
    assert r.status_code == 200


def test_qwen_chat_over_the_server_equals_the_api(qwen_target, qwen_draft):
    """The instruct pair with its GGUF's own template, through the real client."""
    config = shipped("lever.toml")
    sets = ["model.n_ctx=1024", "flash.dram_budget=0.25"]
    msgs = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    with lever.load(config, target=qwen_target, draft=qwen_draft, overrides=sets) as m:
        want = m.chat(msgs, max_tokens=32)
        want_stop = m.chat(msgs, max_tokens=32, stop=["\n\n"])
    extra = ["-c", str(config), "--set", f"model.target={json.dumps(str(qwen_target))}",
             "--set", f"model.draft={json.dumps(str(qwen_draft))}", *(x for s in sets for x in ("--set", s))]
    proc, url = start_server(*extra, template=None)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="x", messages=msgs, max_tokens=32)
        assert r.choices[0].message.content == want.text and r.usage.completion_tokens == len(want.tokens)
        streamed = "".join(ev.choices[0].delta.content or "" for ev in
                           c.chat.completions.create(model="x", messages=msgs, max_tokens=32, stream=True)
                           if ev.choices)
        assert streamed == want.text
        r = c.chat.completions.create(model="x", messages=msgs, max_tokens=32, stop=["\n\n"])
        assert r.choices[0].message.content == want_stop.text
    finally:
        stop(proc, timeout_s=30)


def test_response_format_json_schema_is_followed_and_equals_the_api(client, llm):
    schema = {"type": "object", "properties": {"x": {"type": "integer", "maximum": 99}}, "required": ["x"],
              "additionalProperties": False}
    want = llm.generate(PROMPT, max_tokens=24, json_schema=schema)
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=24,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": schema}}})
    assert r.choices[0].text == want.text
    r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=24, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert r.choices[0].message.content == llm.chat(MESSAGES, max_tokens=24, json_schema=schema).text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=24, stream=True, response_format={"type": "json_object"})
        if c.choices)
    assert streamed == llm.chat(MESSAGES, max_tokens=24, json_schema={"type": "object"}).text
    assert streamed.startswith("{")


def test_a_bad_schema_or_grammar_is_a_400_naming_it(server):
    r = httpx.post(server[1] + "/v1/completions", json={"prompt": PROMPT, "grammar": "root ::= ((("})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
    r = httpx.post(server[1] + "/v1/completions", json={"prompt": PROMPT, "json_schema": {"type": "integer",
                                                                                            "minimum": "a"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                          "required": ["city"], "additionalProperties": False}}}


def test_a_required_tool_call_comes_back_as_tool_calls_plain_and_streamed(client, llm):
    # one call: TEMPLATE offers no tools, so calls are llama.cpp's generic {"tool_calls": [...]}, whose
    # array the shipped pair, left to it, never closes
    one = {"tool_choice": "required", "parallel_tool_calls": False}
    want = llm.chat(MESSAGES, tools=[WEATHER], max_tokens=64, **one)
    r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=64, tools=[WEATHER], **one)
    choice = r.choices[0]
    # a reply cut by max_tokens says so, and a call begun and cut is neither a call nor text
    assert choice.finish_reason == ("length" if want.finish_reason is StopReason.LENGTH else "tool_calls")
    assert choice.message.content == (want.text or None) and "<tool_call>" not in (want.text or "")
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == want.tool_calls[0].arguments
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=64, tools=[WEATHER], stream=True, **one)
        if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert "".join(d.content or "" for d in deltas) == want.text  # what is not a call streams as text
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [("get_weather", call.function.arguments)]
    turn2 = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = client.chat.completions.create(model="x", messages=turn2, max_tokens=8, tools=[WEATHER])
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_parallel_tool_calls_false_makes_a_required_reply_one_call(client, llm):
    """Without it a required reply may hold several calls (a second one begun at 96 tokens
    here); with it, exactly one, and the reply ends after it."""
    several = llm.chat(MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=96)
    one = llm.chat(MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=96, parallel_tool_calls=False)
    assert len(one.tool_calls) == 1 and one.text == "" and one.finish_reason.value == "eos"
    assert len(several.tokens) > len(one.tokens)  # the grammar is what ended `one`
    r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=96, tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.name, c.arguments) for c in one.tool_calls] and r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": False}, "parallel_tool_calls"),
])
def test_bad_tool_requests_get_400_naming_the_field(server, body, param):
    r = httpx.post(server[1] + "/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_conversations_taking_turns_each_prefill_only_what_is_new(client, llm):
    """Two conversations of one client, interleaved: each returning turn comes back from the
    kept conversations (--cache-ram), its answer the same as a fresh prefill's."""
    a = [{"role": "user", "content": "import json"}]
    b = [{"role": "user", "content": "class Stack:"}]
    ra = client.chat.completions.create(model="x", messages=a, max_tokens=12)
    client.chat.completions.create(model="x", messages=b, max_tokens=12)
    a2 = [*a, {"role": "assistant", "content": ra.choices[0].message.content}, {"role": "user", "content": "more"}]
    r = client.chat.completions.create(model="x", messages=a2, max_tokens=12)
    assert r.usage.prompt_tokens_details.cached_tokens >= len(llm.encode_chat(a)) - 1
    assert r.choices[0].message.content == llm.chat(a2, max_tokens=12).text
