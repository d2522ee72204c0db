"""Ollama's API on `lever serve` (lever.serve.ollama), driven by Ollama's own Python client against
a live server on the shipped pair with an API key: its chats and generations equal the OpenAI
routes' answers on the same server (one model, one generation, whichever dialect asks), its
streams their plain answers, its refusals Ollama's errors naming Ollama's fields; a reply's tool
calls read by the client's own types. On the Qwen pair (skipped when absent): fill-in-the-middle
and tools through the model's template."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from lever.api import Chunk, Completion, Usage
from lever.model.stop import StopReason
from lever.model.tool_calls import ToolCall
from lever.serve.ollama import OllamaReply
from lever.shipped import shipped
from tests.serve.live import TEMPLATE, start_server, stop

KEY = "k-ollama"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "import os"}]
PROMPT = "def parse_args(argv):"
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer", "maximum": 99}}, "required": ["x"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    # the template writes the BOS, as most do: a templated generation's prompt is a chat's, token for token
    proc, url = start_server("--api-key", KEY, headers=AUTH, template="{{ bos_token }}" + TEMPLATE)
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server[1], headers=AUTH, timeout=120)


def openai(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json={**body, "temperature": 0}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_and_its_stream_equal_openai_chat(server, client):
    want = openai(server[1], "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 24})
    r = client.chat(model="any", messages=MESSAGES, options={"num_predict": 24, "temperature": 0})
    assert r.message.role == "assistant" and r.message.content == want["choices"][0]["message"]["content"]
    assert r.done and r.done_reason == "length" and r.eval_count == 24
    assert r.prompt_eval_count == want["usage"]["prompt_tokens"]
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0 and r.load_duration == 0
    parts = list(client.chat(model="any", messages=MESSAGES, options={"num_predict": 24}, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert (parts[-1].done_reason, parts[-1].eval_count) == ("length", 24)
    # Ollama's default is a stream: lines of JSON, the last one done
    lines = httpx.post(server[1] + "/api/chat", json={"model": "any", "messages": MESSAGES,
                                                      "options": {"num_predict": 4}}, headers=AUTH, timeout=120)
    assert lines.headers["content-type"].startswith("application/x-ndjson")
    assert json.loads(lines.text.splitlines()[-1])["done"] is True


def test_generate_raw_templated_and_streamed(server, client):
    """raw: the prompt as it is, as /v1/completions takes it; else the prompt as the user's turn
    through the chat template, as a chat of it."""
    raw = client.generate(model="any", prompt=PROMPT, raw=True, options={"num_predict": 16})
    assert raw.response == openai(server[1], "/v1/completions", {"prompt": PROMPT, "max_tokens": 16}
                                  )["choices"][0]["text"]
    assert raw.done_reason == "length" and raw.eval_count == 16
    streamed = list(client.generate(model="any", prompt=PROMPT, raw=True, options={"num_predict": 16}, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done
    templated = client.generate(model="any", prompt="import os", options={"num_predict": 16})
    chat = client.chat(model="any", messages=MESSAGES, options={"num_predict": 16})
    assert templated.response == chat.message.content and templated.context is None


def test_format_is_followed(client):
    r = client.chat(model="any", messages=MESSAGES, format=SCHEMA, options={"num_predict": 40})
    assert json.loads(r.message.content).keys() == {"x"} and r.done_reason == "stop"
    r = client.generate(model="any", prompt=PROMPT, raw=True, format="json", options={"num_predict": 8})
    assert r.response.startswith("{")


def test_tags_show_ps_version(server, client):
    (m,) = client.list().models
    assert m.model == "stdlib-target-q4_0:latest" and m.details.format == "gguf" and m.size > 0
    assert m.details.family == "llama" and m.details.quantization_level and len(m.digest) == 64
    shown = client.show(m.model)
    assert shown.details == m.details and shown.capabilities == ["completion"]
    assert "num_ctx" in shown.parameters and shown.modelinfo["general.architecture"] == "llama"
    (loaded,) = client.ps().models
    assert loaded.model == m.model and loaded.size > 0 and loaded.size_vram == 0 and loaded.context_length > 0
    v = httpx.get(server[1] + "/api/version", headers=AUTH).json()
    assert v["version"].startswith("0.") and "lever" in v


@pytest.mark.parametrize("call, field", [
    (dict(options={"num_ctx": 1 << 20}), "options.num_ctx"),
    (dict(options={"num_predict": 1 << 31}), "options.num_predict"),  # past its bound (past the context: a stop)
    (dict(options={"mirostat": 2}), "options.mirostat"),
    (dict(options={"temperature": -1.0}), "options.temperature"),
    (dict(format={"type": "integer", "minimum": "a"}), "format"),
    (dict(messages=[{"role": "user", "content": "x", "images": ["aGk="]}]), "messages[0].images"),
    (dict(suffix="\n"), "suffix"),  # the shipped pair has no fill-in-the-middle tokens
    (dict(template="{{ .Prompt }}"), "template"),
])
def test_bad_requests_are_400_naming_ollamas_field(client, call, field):
    generate = "suffix" in call or "template" in call
    with pytest.raises(ollama.ResponseError) as e:
        if generate:
            client.generate(model="any", prompt=PROMPT, **call)
        else:
            client.chat(model="any", **{"messages": MESSAGES, **call})
    assert e.value.status_code == 400 and e.value.error.startswith(field + ":"), e.value.error


def test_a_client_without_the_key_is_refused(server):
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server[1], timeout=30).list()
    assert e.value.status_code == 401


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_calls_are_ollamas_shape_plain_and_streamed():
    """A reply's calls as Ollama's client reads them (its own types): arguments an object; in a
    stream, a line of their own before the done line. (No model here writes a call unasked, and
    Ollama's API cannot require one: the live test below sees the tools reach the template.)"""
    calls = (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
    reply = OllamaReply(rid="r", chat=True, model_id="m", tok=None)
    body = ollama.ChatResponse(**reply.body(Completion(text="", tokens=(1, 2), finish_reason=StopReason.EOS,
                                                       usage=Usage(5, 2), stats=None, tool_calls=calls)))
    (tc,) = body.message.tool_calls
    assert (tc.function.name, tc.function.arguments, body.done_reason) == ("get_weather", {"city": "Paris"}, "stop")
    lines = [ollama.ChatResponse(**json.loads(x)) for x in reply.closing(
        Chunk("", 0, StopReason.EOS, usage=Usage(5, 2), tool_calls=calls))]
    assert [x.done for x in lines] == [False, True] and lines[0].message.tool_calls == body.message.tool_calls
    assert (lines[1].prompt_eval_count, lines[1].eval_count) == (5, 2)


def test_qwen_fills_in_the_middle_and_offers_tools(qwen_target, qwen_draft):
    """The instruct coder pair with its GGUF's template: a suffix makes a fill-in-the-middle
    prompt; tools reach the template as OpenAI's route gives them, and a conversation with
    Ollama's call (arguments an object) and tool reply (by `tool_name`) is OpenAI's same one."""
    extra = ["-c", str(shipped("lever.toml")), "--set", f"model.target={json.dumps(str(qwen_target))}",
             "--set", f"model.draft={json.dumps(str(qwen_draft))}", "--set", "model.n_ctx=1024",
             "--set", "flash.dram_budget=0.25"]
    proc, url = start_server(*extra, template=None)
    try:
        c = ollama.Client(host=url, timeout=300)
        assert {"tools", "insert"} <= set(c.show("any").capabilities)
        r = c.generate(model="any", prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n",
                       options={"num_predict": 8})
        assert "a + b" in r.response and r.done
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        want = openai(url, "/v1/chat/completions", {"messages": msgs, "tools": [WEATHER], "max_tokens": 24})
        r = c.chat(model="any", messages=msgs, tools=[WEATHER], options={"num_predict": 24})
        assert r.message.content == want["choices"][0]["message"]["content"] and "get_weather" in r.message.content
        call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        turn2 = [*msgs, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
        as_openai = [*msgs, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        want = openai(url, "/v1/chat/completions", {"messages": as_openai, "tools": [WEATHER], "max_tokens": 16})
        r = c.chat(model="any", messages=turn2, tools=[WEATHER], options={"num_predict": 16})
        assert r.message.content == want["choices"][0]["message"]["content"]
    finally:
        stop(proc, timeout_s=30)
