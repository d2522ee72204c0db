"""Anthropic's Messages API on `lever serve` (lever.serve.anthropic), as Anthropic's own client
sees it: a live server with a key, its messages equal streamed or not and equal to OpenAI's chat
route for the same conversation, its stops, tool calls and refusals in Anthropic's shapes."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from lever.shipped import shipped
from tests.serve.live import start_server, stop

KEY = "k-anthropic"
SYSTEM = "You write Python."
MESSAGES = [{"role": "user", "content": "import os"}]
GREEDY = {"temperature": 0}  # Anthropic's client takes the knobs in extra_body
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
# the same tool in OpenAI's shape, description too: a template that prints the tools must get the same prompt
FUNCTION = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                             "parameters": WEATHER["input_schema"]}}
ONE_CALL = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--api-key", KEY)
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[1], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def answered(use, result: str) -> list[dict]:
    """A tool_use block and its result, as Anthropic's next turns."""
    return [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]


def as_openai(use, result: str) -> list[dict]:
    """The same turns as OpenAI's messages."""
    call = {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": use.id, "content": result}]


def test_a_message_streamed_or_not_equals_openais_chat(client, oai):
    """Lossless and consistent: the same reply whether streamed, and as /v1/chat/completions gives it."""
    r = client.messages.create(model="x", max_tokens=8, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 8 and text_of(r)
    with client.messages.stream(model="x", max_tokens=8, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text_of(r) == text_of(final) and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8
    want = oai.chat.completions.create(model="x", max_tokens=8, temperature=0,
                                       messages=[{"role": "system", "content": SYSTEM}, *MESSAGES])
    assert text_of(r) == want.choices[0].message.content
    n_prompt = want.usage.prompt_tokens
    for u in (r.usage, final.usage):  # a kept conversation's prefix is read from the cache, not prefilled
        assert u.input_tokens + (u.cache_read_input_tokens or 0) == n_prompt
    assert client.messages.count_tokens(model="x", system=SYSTEM, messages=MESSAGES).input_tokens == n_prompt
    assert client.messages.count_tokens(model="x", messages=MESSAGES).input_tokens < n_prompt


def test_a_stop_sequence_or_a_schema_shapes_the_message(client, oai):
    full = text_of(client.messages.create(model="x", max_tokens=24, messages=MESSAGES, extra_body=GREEDY))
    stop_at = full[6:9]
    r = client.messages.create(model="x", max_tokens=24, messages=MESSAGES, stop_sequences=[stop_at],
                               extra_body=GREEDY)
    assert text_of(r) == full[: full.find(stop_at)] and r.stop_reason == "stop_sequence"
    assert r.stop_sequence.startswith(stop_at)  # the stop token's text: it may run past the sequence
    with client.messages.stream(model="x", max_tokens=24, messages=MESSAGES, stop_sequences=[stop_at],
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert (text_of(final), final.stop_reason, final.stop_sequence) == (text_of(r), r.stop_reason, r.stop_sequence)
    want = oai.chat.completions.create(model="x", max_tokens=24, temperature=0, messages=MESSAGES, stop=[stop_at])
    assert text_of(r) == want.choices[0].message.content
    schema = {"type": "object", "properties": {"x": {"type": "integer", "maximum": 99}}, "required": ["x"],
              "additionalProperties": False}
    r = client.messages.create(model="x", max_tokens=24, messages=MESSAGES, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    want = oai.chat.completions.create(model="x", max_tokens=24, temperature=0, messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert text_of(r) == want.choices[0].message.content and text_of(r).startswith("{")


def test_a_named_tool_comes_back_as_a_tool_use_block_and_its_result_goes_back(client, oai):
    r = client.messages.create(model="x", max_tokens=96, messages=MESSAGES, tools=[WEATHER], tool_choice=ONE_CALL)
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input, dict)
    assert r.stop_reason == "tool_use" and set(use.input) == {"city"}
    with client.messages.stream(model="x", max_tokens=96, messages=MESSAGES, tools=[WEATHER],
                                tool_choice=ONE_CALL) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", use.name, use.input)]
    assert final.stop_reason == "tool_use"
    want = oai.chat.completions.create(model="x", max_tokens=96, messages=MESSAGES, tools=[FUNCTION],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       parallel_tool_calls=False).choices[0].message.tool_calls[0].function
    assert json.loads(want.arguments) == use.input
    # the call and its result, as the next turn: the same conversation as OpenAI's messages
    r2 = client.messages.create(model="x", max_tokens=8, messages=[*MESSAGES, *answered(use, "sunny")],
                                tools=[WEATHER], extra_body=GREEDY)
    want2 = oai.chat.completions.create(model="x", max_tokens=8, temperature=0, tools=[FUNCTION],
                                        messages=[*MESSAGES, *as_openai(use, "sunny")])
    assert text_of(r2) == (want2.choices[0].message.content or "")


def test_refusals_are_anthropics_errors_naming_the_field(client, server):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens") as e:
        client.messages.create(model="x", max_tokens=anthropic.NOT_GIVEN, messages=MESSAGES)
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]: image"):
        client.messages.create(model="x", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}])
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):  # Lever's bound, by Anthropic's name
        client.messages.create(model="x", max_tokens=8, messages=MESSAGES, stop_sequences=["x" * 300])
    wrong = anthropic.Anthropic(base_url=server[1], api_key="k-wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="x", max_tokens=8, messages=MESSAGES)
    assert e.value.status_code == 401


def test_a_qwen_tool_call_through_its_own_template(qwen_target, qwen_draft):
    """The instruct pair's template shows the tools, the call and its result: the model fills the
    call's input from the question, and the next turn is the one OpenAI's route renders."""
    sets = ["model.n_ctx=1024", "flash.dram_budget=0.25", f"model.target={json.dumps(str(qwen_target))}",
            f"model.draft={json.dumps(str(qwen_draft))}"]
    proc, url = start_server("-c", str(shipped("lever.toml")), *(x for s in sets for x in ("--set", s)), template=None)
    try:
        c = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        with c.messages.stream(model="x", max_tokens=48, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
            r = s.get_final_message()
        (use,) = r.content
        assert r.stop_reason == "tool_use" and (use.name, use.input) == ("get_weather", {"city": "Paris"}), r
        r2 = c.messages.create(model="x", max_tokens=24, messages=[*ask, *answered(use, "Sunny, 25 C")],
                               tools=[WEATHER], extra_body=GREEDY)
        want = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=300).chat.completions.create(
            model="x", max_tokens=24, temperature=0, tools=[FUNCTION], messages=[*ask, *as_openai(use, "Sunny, 25 C")])
        assert text_of(r2) == want.choices[0].message.content, (r2, want)
    finally:
        stop(proc, timeout_s=30)


def test_an_earlier_turns_thinking_is_its_reasoning_content():
    """llama-server's reading: thinking blocks joined as the assistant message's reasoning_content
    (a template such as Qwen3's shows it), redacted ones left out."""
    from lever.serve.anthropic import translate

    turn = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "first ", "signature": "s"}, {"type": "redacted_thinking", "data": "x"},
        {"type": "thinking", "thinking": "then", "signature": "s"},
        {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Oslo"}}]}
    data = translate({"model": "m", "max_tokens": 8, "messages": [*MESSAGES, turn, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}]})
    reply = data["messages"][1]
    assert reply["role"] == "assistant" and reply["reasoning_content"] == "first then" and reply["content"] == ""
    assert reply["tool_calls"][0]["function"]["name"] == "get_weather"
    alone = translate({"model": "m", "max_tokens": 8, "messages": [*MESSAGES, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"}]}, {"role": "user", "content": "go on"}]})
    assert alone["messages"][1] == {"role": "assistant", "content": "", "reasoning_content": "hm"}
