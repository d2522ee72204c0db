"""OpenAI's Responses API on `lever serve` (lever.serve.responses), as OpenAI's own client sees
it: a response equal to the chat route's for the same conversation, streamed or not (its events
in order, their text the response's), an earlier turn and function calls as input items, its
counts, and what the model cannot read refused by name."""

from __future__ import annotations

import json

import httpx
import pytest

SYSTEM = "You write Python."
INPUT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "import os"}]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


def test_a_response_is_the_chat_routes_reply(client):
    chat = client.chat.completions.create(model="x", messages=INPUT, max_tokens=12, temperature=0)
    r = client.responses.create(model="x", input=INPUT, max_output_tokens=12, temperature=0)
    assert r.id.startswith("resp_") and r.status == "completed" and r.output[0].id.startswith("msg_")
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    # instructions are the system message, a text input the user's
    same = client.responses.create(model="x", instructions=SYSTEM, input="import os", max_output_tokens=12,
                                   temperature=0)
    assert same.output_text == r.output_text


def test_a_streamed_response_is_the_same_text_in_its_events_order(client):
    whole = client.responses.create(model="x", input=INPUT, max_output_tokens=12, temperature=0)
    kinds, text, done = [], "", None
    for ev in client.responses.create(model="x", input=INPUT, max_output_tokens=12, temperature=0, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            done = ev.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert text == done.output_text == whole.output_text and done.usage.output_tokens == 12


def test_earlier_turns_and_function_calls_as_input_items(client, server):
    """An assistant's earlier output and a call with its output read as the chat's turns (the
    same prompt's tokens as OpenAI chat's messages); a forced call comes back as a function_call."""
    call_id = "call_abc"
    items = [*INPUT, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x = 1"}]},
             {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": call_id, "output": "sunny"}]
    messages = [*INPUT, {"role": "assistant", "content": "x = 1", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    n_resp = httpx.post(server[1] + "/v1/responses/input_tokens", json={"input": items, "tools": [WEATHER]}).json()
    n_chat = httpx.post(server[1] + "/chat/completions/input_tokens", json={"messages": messages, "tools": tools})
    assert n_resp["input_tokens"] == n_chat.json()["input_tokens"] > 0
    r = client.responses.create(model="x", input=INPUT, tools=[WEATHER], max_output_tokens=96,
                                tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    chat = client.chat.completions.create(model="x", messages=INPUT, tools=tools, max_tokens=96,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          parallel_tool_calls=False)
    calls = [(o.name, o.arguments, o.call_id) for o in r.output if o.type == "function_call"]
    want = [(tc.function.name, tc.function.arguments) for tc in chat.choices[0].message.tool_calls]
    assert [c[:2] for c in calls] == want and "city" in json.loads(calls[0][1]) and calls[0][2].startswith("call_")


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]},
     "input[0].content[0]"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"instructions": "x"}, "input"),
])
def test_what_lever_cannot_honour_is_refused_by_name(server, body, param):
    r = httpx.post(server[1] + "/v1/responses", json={"max_output_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
