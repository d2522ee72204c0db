"""llama-server's own routes on `lever serve` (lever.serve.llama): /completion in its shapes,
equal to the API's output; OpenAI's routes without /v1; /apply-template; /slots; /infill's
fill-in-the-middle on the Qwen pair equal to plain greedy decoding of the same FIM prompt."""

from __future__ import annotations

import json

import httpx
import pytest

import lever
from lever.gguf.fim import Extra, FimTokens, fim_ids
from tests.serve.live import start_server, stop

PROMPT = "def parse_args(argv):"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server[1] + path, json=body, timeout=300)


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server[1] + path, json=body, timeout=300) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")
                and line != "data: [DONE]"]


def test_completion_in_llama_servers_shape_equals_the_api(server, llm):
    want = llm.generate(PROMPT, max_tokens=20)
    body = post(server, "/completion", {"prompt": PROMPT, "n_predict": 20, "return_tokens": True}).json()
    assert body["content"] == want.text and body["tokens"] == list(want.tokens) and body["stop"] is True
    assert body["stop_type"] == "limit" and body["tokens_predicted"] == 20
    assert body["tokens_evaluated"] == want.usage.prompt_tokens and body["timings"]["predicted_n"] == 20
    assert body["generation_settings"]["n_predict"] == 20 and isinstance(body["has_new_line"], bool)
    # a prompt of token ids is that prompt; without return_tokens, no ids
    ids = llm.tokenizer.encode(PROMPT)
    again = post(server, "/completion", {"prompt": ids, "n_predict": 20}).json()
    assert again["content"] == want.text and again["tokens"] == []


def test_a_streamed_completion_is_the_same_text_with_its_ids(server):
    whole = post(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "return_tokens": True}).json()
    evs = events(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "stream": True})
    assert all(isinstance(e["stop"], bool) for e in evs) and evs[-1]["stop"] and not any(e["stop"] for e in evs[:-1])
    assert "".join(e["content"] for e in evs) == whole["content"]
    assert [t for e in evs[:-1] for t in e["tokens"]] == whole["tokens"]
    assert evs[-1]["stop_type"] == "limit" and evs[-1]["timings"]["predicted_n"] == 16


def test_openai_routes_answer_without_v1_and_chats_start_with_null_content(server):
    with_v1 = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}).json()
    without = post(server, "/completions", {"prompt": PROMPT, "max_tokens": 8}).json()
    assert with_v1["choices"][0]["text"] == without["choices"][0]["text"] and without["system_fingerprint"]
    assert httpx.get(server[1] + "/models").json()["data"][0]["id"] == "stdlib-target-q4_0"
    assert httpx.get(server[1] + "/v1/health").status_code == 200
    msgs = [{"role": "user", "content": [{"type": "text", "text": "import"}, {"type": "text", "text": "os"}]}]
    evs = events(server, "/chat/completions", {"messages": msgs, "max_tokens": 4, "stream": True})
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    joined = [{"role": "user", "content": "import\nos"}]  # text parts joined by lines, as llama-server joins them
    assert post(server, "/apply-template", {"messages": msgs}).json() == \
        post(server, "/apply-template", {"messages": joined}).json()
    bad = post(server, "/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert bad.status_code == 400 and "content[0]" in bad.json()["error"]["message"]


def test_slots_is_not_served_and_bad_ids_are_named(server):
    r = httpx.get(server[1] + "/slots")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    r = post(server, "/completion", {"prompt": [1, 2, 10**9], "n_predict": 2})
    assert r.status_code == 400 and "1000000000" in r.json()["error"]["message"]


def test_infill_needs_fim_tokens(server):
    r = post(server, "/infill", {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 4})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


CASES = [("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n", []),
         ("import os\n\ndef size(path):\n    return ", "\n", [Extra("util.py", "X = 1\n")]),
         ("class Point:\n    def __init__(self, x, y):\n        ", "\n    def norm(self):\n        return 0\n", [])]


@pytest.fixture(scope="module")
def qwen_server(qwen_target, qwen_draft):
    s = start_server("-m", str(qwen_target), "-md", str(qwen_draft), "--ctx-size", "1024", template=None)
    yield s
    stop(s[0])


@pytest.mark.parametrize("prefix,suffix,extra", CASES)
def test_infill_equals_greedy_decoding_of_the_fim_prompt(qwen_server, qwen_target, prefix, suffix, extra):
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 24, "return_tokens": True,
            "input_extra": [{"filename": x.filename, "text": x.text} for x in extra]}
    got = post(qwen_server, "/infill", body).json()
    with lever.load(target=qwen_target, kind="flash-ar", n_ctx=1024) as ar:  # the target's own greedy decoding
        assert FimTokens.of(ar.tokenizer).prefix in (ids := fim_ids(ar.tokenizer, prefix=prefix, suffix=suffix,
                                                                    extra=extra, n_room=1024 - 24))
        want = ar.run(ar.prepare(ids=ids, max_tokens=24))
    assert got["tokens"] == list(want.tokens) and got["content"] == want.text
    assert got["tokens_evaluated"] == len(ids)
