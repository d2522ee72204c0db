"""Tool calls through `lever serve` in each family's format: the server given a real template of
the family (llama.cpp's models/templates) as its chat template, a required call comes back to the
openai client as tool_calls, plain and streamed; what the model wrote (its tokens, by logprobs) is
the family's format, constrained by that format's grammar; the call goes back into the
conversation as the family's template writes it (Mistral's insist on their ids' shape)."""

from __future__ import annotations

import json
import re

import openai
import pytest

from lever.model.tool_calls import BY_NAME, parse_calls
from tests.llama_templates import templates
from tests.serve.live import start_server, stop

# family: (a template of it, how the model's reply begins in its format)
FAMILIES = {
    "hermes": ("Qwen-Qwen2.5-7B-Instruct", '<tool_call>\n{"name": "get_weather", "arguments": {'),
    "llama3": ("meta-llama-Llama-3.1-8B-Instruct", '{"name": "get_weather", "parameters": {'),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407", '[TOOL_CALLS][{"name": "get_weather", "arguments": {'),
    "mistral-args": ("mistralai-Ministral-3-14B-Reasoning-2512", "[TOOL_CALLS]get_weather[ARGS]{"),
    "mistral-ids": ("Mistral-Small-3.2-24B-Instruct-2506", "[TOOL_CALLS]get_weather[CALL_ID]"),
    "firefunction": ("fireworks-ai-llama-3-firefunction-v2", 'functools[{"name": "get_weather", "arguments": {'),
    "json": ("moonshotai-Kimi-K2", '```json\n{"name": "get_weather", "arguments": {'),  # its own markup is not read
    "generic": ("microsoft-Phi-3.5-mini-instruct", '{"tool_calls": [{"name": "get_weather", "arguments": {'),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
# a system message of its own: Mistral Small's default one would not leave the reply room in the
# shipped pair's context of 512
ASK = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "What is the weather in Paris right now?"}]
# one call, so the reply ends after it (the shipped pair, left to it, writes calls to its token limit)
REQUIRED = {"model": "x", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 64}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request):
    proc, url = start_server(template=(templates() / f"{FAMILIES[request.param][0]}.jinja").read_text())
    yield request.param, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stop(proc)


def test_a_required_call_comes_back_written_in_the_familys_format(served):
    family, client = served
    r = client.chat.completions.create(**REQUIRED, logprobs=True)
    choice = r.choices[0]
    written = "".join(t.token for t in choice.logprobs.content)  # the reply's tokens: the call as the model wrote it
    assert written.startswith(FAMILIES[family][1]), written
    text, (want,) = parse_calls(written, {"get_weather"}, BY_NAME[family])
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and text == ""
    assert (call.function.name, call.function.arguments) == (want.name, want.arguments)
    assert set(json.loads(call.function.arguments)) == {"city"}
    if family.startswith("mistral"):
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)  # what Mistral's templates take back
    if family in ("mistral", "mistral-ids"):
        assert call.id in written  # the model's own id, kept
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**REQUIRED, stream=True) if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert not "".join(d.content or "" for d in deltas)
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [("get_weather", call.function.arguments)]
    turn2 = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = client.chat.completions.create(model="x", messages=turn2, tools=[WEATHER], max_tokens=4)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
